"""scripts/share_torch.py: which top-level entries of a site-packages folder count as PyTorch's family."""

from __future__ import annotations

from pathlib import Path

import share_torch


def _install(site: Path, name: str, version: str, files: list[str], requires: tuple[str, ...] = ()) -> None:
    """A minimal installed distribution: its files, and a dist-info whose RECORD lists them."""
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    (site / info).mkdir()
    requires_dist = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (site / info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires_dist}")
    for file in files:
        if not file.startswith(".."):
            (site / file).parent.mkdir(parents=True, exist_ok=True)
            (site / file).write_text("")
    record = [*files, f"{info}/METADATA", f"{info}/RECORD"]
    (site / info / "RECORD").write_text("".join(f"{f},,\n" for f in record))


def test_the_family_is_what_torch_and_torchvision_require_of_cuda_nvidia_and_triton(tmp_path):
    site = tmp_path / "site-packages"
    site.mkdir()
    _install(site, "torch", "2.14.1", ["torch/__init__.py", "torchgen/__init__.py", "../../../bin/torchrun"],
             ("filelock", "cuda-toolkit[cublas]==13.0.3; python_version >= '3'", "cuda-bindings<14,>=13",
              "triton~=3.8.0", "optree>=0.13.0; extra == 'optree'"))
    _install(site, "torchvision", "0.29.1", ["torchvision/__init__.py", "torchvision.libs/libpng.so"],
             ("torch==2.14.1", "numpy"))
    # cuda-toolkit's extras pull in its libraries: [cublas] is asked for, [cufft] is not
    _install(site, "cuda-toolkit", "13.0.3", ["cuda/toolkit.py"],
             ("nvidia-cublas==13.1; extra == 'cublas'", "nvidia-cufft==12.0; extra == 'cufft'"))
    _install(site, "nvidia-cublas", "13.1", ["nvidia/cublas/lib/libcublas.so"])
    _install(site, "nvidia-cufft", "12.0", ["nvidia/cufft/lib/libcufft.so"])
    _install(site, "cuda-bindings", "13.5", ["cuda/bindings/__init__.py"])
    _install(site, "triton", "3.8.0", ["triton/__init__.py"])
    # neither required nor heavy: installed by the target itself (filelock, numpy), or not PyTorch's (the rest)
    _install(site, "filelock", "3.0", ["filelock/__init__.py"])
    _install(site, "optree", "0.13.0", ["optree/__init__.py"])
    _install(site, "torchmetrics", "1.9.0", ["torchmetrics/__init__.py"], ("torch",))
    _install(site, "nvidia-ml-py", "12.0", ["pynvml.py"])
    _install(site, "numpy", "2.4.6", ["numpy/__init__.py"])

    assert share_torch.family_entries(site) == {
        "torch", "torchgen", "torch-2.14.1.dist-info",
        "torchvision", "torchvision.libs", "torchvision-0.29.1.dist-info",
        "nvidia", "nvidia_cublas-13.1.dist-info",
        "cuda", "cuda_bindings-13.5.dist-info", "cuda_toolkit-13.0.3.dist-info",
        "triton", "triton-3.8.0.dist-info",
    }
