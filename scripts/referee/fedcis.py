"""Fed-CIS against the authors' released code (arodio/FedCIS): their serving rates, per-exit aggregation weights and
server aggregation, and ours, on the same trees, data splits and client updates.

The authors' ``trainingtopologies/custom_training_topology.py`` runs as released: ``Train.__init__`` reads their
spec files (tree, exits, arrival/departure rates) and computes the per-exit serving rates ``s_e``;
``Train.compute_profiles`` hands them to the nodes; ``Train.aggregate`` (``--agg-strategy pgrads``) applies Algorithm
6's update. Their ``utils.load_args`` parses the flags of their scripts (``scripts-fl-3-9-17-*``), and the nodes hold
their own ``models/resnets.py`` ``ResNetEE`` (blocks ``3-2-2-2``, exits at layers 3-9-17, width 4, float64 as their
``--float64`` flag does). Replaced in memory: the node class (``fedclients.aggregator.Aggregator`` builds CIFAR-10
loaders and optimisers; here a node is its exit count, its training-set size from their split file and its
model) and the data loader; stubbed because absent here: ``loguru``, ``fvcore``, ``alive_progress``, ``pandas``.

Three comparisons:

1. serving rates: their ``s_e`` against ``CISTopology(...).serving_rates()`` built from the same spec;
2. per-(node, exit) weights: every node that may train exit ``e`` moves one coordinate of its own by 1 and their
   ``aggregate`` is run from a zero global model; the global model's coordinate is their weight
   ``Lt_e |D_c| / |D_e| p_ce``, compared with ``FedCIS(...).pair_weights()`` (``prob_weighting="direct"``);
3. the whole update from random client updates (each node changes its trained exit's sub-model): their
   ``aggregate`` against ``FedCIS`` with ``aggregation_base="literal"`` (global model separate from the root's) and
   ``"root_local"`` (their runs: the global model *is* node 0's model, ``load_nodes_states``), per parameter group,
   with the exit heads aggregated (``aggregate_heads=True``, Algorithm 6 as written) and not (``False``, what their
   ``aggregate`` does).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import _common
import numpy as np
import torch
import torch._dynamo  # noqa: F401  (imported before the stubs: it scans for optional packages by name)
import torchvision.models.resnet  # noqa: F401  (their models import it)

from lightning_fedhet.algorithms.base import ClientInfo
from lightning_fedhet.algorithms.fedcis import FedCIS, code_sampling_matrix
from lightning_fedhet.cis import CISTopology

STUDY = "fedcis"
REPO = "arodio/FedCIS"
MODULES = ("utils", "args", "fedclients", "models", "trainingtopologies", "dataloaders", "loguru", "fvcore",
           "alive_progress", "pandas")
FILES = ["trainingtopologies/custom_training_topology.py", "utils/utils.py", "args.py", "models/resnets.py",
         "specs/*.json"]
STRATEGIES = {0: "serving_rate", 1: "equal"}
SAMPLED = {"0.0-0.0": {2: 0.0, 3: 0.0}, "0.4-0.8": {2: 0.4, 3: 0.8}}


def stubs() -> list[str]:
    out = []
    for name, attrs in (("loguru", {"logger": _common.Anything()}),
                        ("fvcore.nn", {"FlopCountAnalysis": _common.Anything}),
                        ("alive_progress", {"alive_bar": _common.Anything}),
                        ("pandas", {"read_csv": _common.Anything})):
        if _common.stub_missing(name, **attrs):
            out.append(name)
    return out


def load_spec(path: Path) -> tuple[dict, bool]:
    """Their spec; ``5-15-80`` at 7c7f1bc holds ``#`` comments (not JSON), which are cut here. True if cut."""
    text = path.read_text()
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        return json.loads("\n".join(line.split("#")[0] for line in text.splitlines())), True


def build_train(mods, spec_path: Path, split_path: Path, strategy: int, sampled: str, tmp: Path):
    """Their ``Train`` for one spec / split / strategy / sampling flag (their script's flags)."""
    utils_mod, ct, resnets = mods
    spec, cut = load_spec(spec_path)
    if cut:
        spec_path = tmp / spec_path.name
        spec_path.write_text(json.dumps(spec))
    sys.argv = ["main.py", "--resnet-layers_per_classifier", "3-9-17", "--resnet-layers-widths", "3-2-2-2",
                "--data", "cifar10", "--arch", "resnet", "--specs-dataset-split", str(split_path),
                "--specs-topology", str(spec_path), "--sampled-probability-per-layer", sampled,
                "--lambda-tilde-strategy", str(strategy), "--float64", "--resnet-nChannels", "4",
                "--save", str(tmp)]
    args = utils_mod.load_args()
    split = json.loads(split_path.read_text())["node_dataset_assignment"]

    class Node:
        """A node: its exit count, sampling probability (as ComputeNode sets it), data size and model."""

        def __init__(self, nEE, loader, epoch, args, children, parent, client_id=0) -> None:
            self.nEE, self.args, self.node_name = nEE, args, f"Node_{client_id}_"
            self.sampled_probability = args.sampled_probability[nEE - 1]  # fedclients/computeNode.py:27
            self.dataset_size = len(split[str(client_id)]["train"])
            model = resnets.ResNetEE(args.layers_widths, nClassifiers=args.nClassifiers,
                                     growth=args.resnet_growthRate, channels=args.resnet_nChannels,
                                     num_classes=args.num_classes, init_res=False,
                                     layers_per_classifier=args.layers_per_classifier)
            model.set_nBlocks(nEE)  # fedclients/computeNode.py:38
            self.model = model.double()

    class Loader:
        def __init__(self, args) -> None:
            pass

        def get_full_test_data(self):
            return None

    ct.Aggregator, ct.DataLoader = Node, Loader
    with _common.quiet():
        train = ct.Train(args)
        train.compute_profiles()
    return train, spec, cut


def topology_of(spec: dict, sizes: list[int]) -> CISTopology:
    n = len(spec["node_model_size"])
    children = [[] for _ in range(n)]
    for a, b in spec["toplogy_as_edges"]:
        children[a].append(b)
    max_exit = [spec["node_model_size"][str(i)] for i in range(n)]
    arrival = [spec["rates"]["arrival"][str(i)] for i in range(n)]
    cap = [spec["rates"]["departure"][str(i)] for i in range(n)]
    return CISTopology(children, max_exit, arrival, cap, data_fraction=sizes)


def zero_(model) -> None:
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.dtype.is_floating_point:
                v.zero_()


def their_pair_weights(train) -> np.ndarray:
    """``[N, E]``: node ``c`` moves coordinate ``c`` of the first tensor of block 0 by 1 (every exit's sub-model
    holds block 0); one ``aggregate`` per exit from a zero global model reads every node's weight off it."""
    n, num_exits = len(train.nodes), train.nodes[0].nEE
    out = np.zeros((n, num_exits))
    for e in range(num_exits):
        zero_(train.cloud_model)
        eligible = {}
        for c, node in train.nodes.items():
            zero_(node.model)
            if e == node.nEE - 1 or (e < node.nEE - 1 and node.sampled_probability > 0):
                eligible[c] = e
                with torch.no_grad():
                    next(node.model.blocks[0].parameters()).view(-1)[c] = 1.0
        train.sampled_nodes_exits = eligible
        with _common.quiet():
            train.aggregate(0)
        probe = next(train.cloud_model.blocks[0].parameters()).detach().view(-1)
        for c in eligible:
            out[c, e] = float(probe[c])
    return out


def parameter_groups(model) -> dict[str, str]:
    """Parameter name -> ``"blocks"`` or ``"heads"``."""
    return {k: ("heads" if k.startswith("classifiers.") else "blocks") for k, _ in model.named_parameters()}


def trained_names(model, e: int, layers) -> set[str]:
    """The parameters a node training exit ``e`` (0-based) changes: blocks before the exit, and the exit's head."""
    last = int(layers[e]) - 1
    return {k for k, _ in model.named_parameters()
            if (k.startswith("blocks.") and int(k.split(".")[1]) <= last) or k.startswith(f"classifiers.{last}.")}


def flat(model, names: list[str]) -> torch.Tensor:
    params = dict(model.named_parameters())
    return torch.cat([params[k].detach().reshape(-1) if k in params else torch.zeros(0) for k in names])


def compare_update(train, strategy: str, sizes: list[int], topo: CISTopology, base: str, seed: int,
                   heads: bool = True) -> dict:
    """Random updates of every node on its own exit (p = 0); their aggregate vs the library's (exit heads aggregated
    or not: ``heads``), per group."""
    layers = train.cloud_model.layers_per_classifier
    root_model = train.nodes[0].model
    names = [k for k, _ in root_model.named_parameters()]
    shapes = {k: p.shape for k, p in root_model.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    start = {k: torch.randn(shapes[k], generator=gen, dtype=torch.float64) for k in names}
    deltas = {}
    for c, node in train.nodes.items():
        e = node.nEE - 1
        keep = trained_names(node.model, e, layers)
        deltas[c] = {k: torch.randn(shapes[k], generator=gen, dtype=torch.float64) if k in keep else None
                     for k in names}
        with torch.no_grad():
            for k, p in node.model.named_parameters():
                p.copy_(start[k] + (deltas[c][k] if deltas[c][k] is not None else 0.0))
    cloud = train.cloud_model if base == "literal" else train.nodes[0].model
    if base == "literal":
        with torch.no_grad():
            for k, p in cloud.named_parameters():
                p.copy_(start[k])
    train.cloud_model = cloud
    train.sampled_nodes_exits = {c: node.nEE - 1 for c, node in train.nodes.items()}
    with _common.quiet():
        train.aggregate(0)
    theirs = flat(cloud, names)

    # the library: the same start, the same deltas as flat vectors (0 outside the trained sub-model)
    w0 = torch.cat([start[k].reshape(-1) for k in names])
    vec = {c: torch.cat([(d[k] if d[k] is not None else torch.zeros(shapes[k], dtype=torch.float64)).reshape(-1)
                         for k in names]) for c, d in deltas.items()}
    kwargs = {}
    if base == "root_local":
        # the library's documented masks: blocks up to exit e and exit e's head (fedcis.py, point 2)
        masks = torch.zeros(len(layers), w0.numel(), dtype=torch.bool)
        for e in range(len(layers)):
            keep = trained_names(root_model, e, layers)
            masks[e] = torch.cat([torch.full((shapes[k].numel(),), k in keep) for k in names])
        kwargs = {"exit_masks": masks}
    if not heads:
        # every head of their model (one per block; the forward pass reads those after blocks 3, 9, 17)
        kwargs["head_mask"] = torch.cat([torch.full((shapes[k].numel(),), k.startswith("classifiers."))
                                         for k in names])
    algo = FedCIS(topo, lambda_tilde=strategy, p=0.0, prob_weighting="direct", aggregation_base=base,
                  aggregate_heads=heads, **kwargs)
    n = len(train.nodes)
    algo.setup(n, w0, client_sizes=torch.tensor(sizes))
    algo.select(0, torch.ones(n, dtype=torch.bool), np.random.default_rng(0))
    algo.open_round(0, None)
    for c in range(n):
        algo.add(c, vec[c], ClientInfo(num_samples=1, local_steps=1))
    ours = algo.close_round()
    groups = parameter_groups(root_model)
    out = {}
    offset = 0
    diff = (theirs - ours).abs()
    moved_theirs = (theirs - w0).abs()
    moved_ours = (ours - w0).abs()
    per = {"blocks": [], "heads": []}
    for k in names:
        size = shapes[k].numel()
        per[groups[k]].append((diff[offset:offset + size].max(), moved_theirs[offset:offset + size].max(),
                               moved_ours[offset:offset + size].max()))
        offset += size
    for g, vals in per.items():
        out[g] = {"max_abs_diff": float(max(v[0] for v in vals)),
                  "moved_theirs": float(max(v[1] for v in vals)), "moved_ours": float(max(v[2] for v in vals))}
    return out


def code_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*.py")):
        if "specs" not in p.relative_to(folder).parts:
            h.update(p.relative_to(folder).as_posix().encode() + p.read_bytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], [
        (("--authors-head",), {"type": Path, "default": None,
                               "help": "an export of their latest commit, for its 100-node specs (optional)"}),
    ])
    torch.set_num_threads(1)
    argv = sys.argv
    tmp = Path(tempfile.mkdtemp(prefix="referee-fedcis-"))
    trees = []  # (label, spec files, split files, folder)
    specs = args.authors / "specs"
    seven = sorted(p for p in specs.glob("3-layer-tree-*.json") if "17_clients" not in p.name)
    splits7 = [specs / f"configuration-cifar10-federated-3-layer-tree-{s}.json" for s in ("eq", "d_to_n-2x",
                                                                                          "d_to_n-tiny_n1")]
    trees.append(("7-node", seven, splits7))
    seventeen = sorted(specs.glob("3-layer-tree-*-17_clients.json"))
    trees.append(("17-node", seventeen, [specs / "configuration-cifar10-federated-3-layer-tree-eq-17_clients.json"]))
    head_note = "no --authors-head given: the 100-node specs were not compared"
    if args.authors_head is not None:
        hs = args.authors_head.resolve() / "specs"
        trees.append(("100-node", sorted(hs.glob("3-layer-tree-*.json")),
                      [hs / f"configuration-cifar10-federated-3-layer-tree-{s}.json" for s in ("eq", "d_to_n-2x",
                                                                                               "d_to_n-tiny_n1")]))
        same = code_hash(args.authors) == code_hash(args.authors_head.resolve())
        head_commit = (args.authors_head / ".referee-commit").read_text().strip() \
            if (args.authors_head / ".referee-commit").is_file() else "unknown"
        head_note = (f"100-node specs from their latest commit {head_commit[:7]} (every .py file outside specs/ "
                     f"{'identical to' if same else 'DIFFERENT from'} the commit whose code ran)")
    rate_rows, weight_rows, rate_diff, weight_diff, combos, pairs, cut_files = [], [], 0.0, 0.0, 0, 0, []
    update_rows, update = [], {}
    try:
        with _common.authors_on_path(args.authors, MODULES):
            stubbed = stubs()
            from models import resnets
            from trainingtopologies import custom_training_topology as ct
            from utils import utils as utils_mod

            mods = (utils_mod, ct, resnets)
            for label, spec_files, split_files in trees:
                tree_rate, tree_weight, tree_combos, tree_pairs = 0.0, 0.0, 0, 0
                for spec_path in spec_files:
                    for split_path in split_files:
                        for strategy, name in STRATEGIES.items():
                            for flag, smaller in SAMPLED.items():
                                train, spec, cut = build_train(mods, spec_path, split_path, strategy, flag, tmp)
                                if cut and f"{label}: {spec_path.name}" not in cut_files:
                                    cut_files.append(f"{label}: {spec_path.name}")
                                sizes = [train.nodes[i].dataset_size for i in range(len(train.nodes))]
                                topo = topology_of(spec, sizes)
                                s_e = np.array([train.rates.s_e[e] for e in range(topo.num_exits)])
                                tree_rate = max(tree_rate, float(np.abs(s_e - topo.serving_rates().numpy()).max()))
                                theirs = their_pair_weights(train)
                                algo = FedCIS(topo, lambda_tilde=name, p=code_sampling_matrix(topo, smaller),
                                              prob_weighting="direct")
                                algo.setup(len(sizes), torch.zeros(1), client_sizes=torch.tensor(sizes))
                                ours = algo.pair_weights().numpy()
                                tree_weight = max(tree_weight, float(np.abs(theirs - ours).max()))
                                tree_combos += 1
                                tree_pairs += int((ours > 0).sum())
                                if (label, spec_path.name, split_path.name, strategy, flag) == (
                                        "7-node", "3-layer-tree-80-15-5.json",
                                        "configuration-cifar10-federated-3-layer-tree-eq.json", strategy, "0.0-0.0"):
                                    for base in ("literal", "root_local"):
                                        for heads in (True, False):
                                            train_b, _, _ = build_train(mods, spec_path, split_path, strategy, flag,
                                                                        tmp)
                                            update[(name, base, heads)] = compare_update(train_b, name, sizes, topo,
                                                                                         base, 0, heads)
                rate_diff, weight_diff = max(rate_diff, tree_rate), max(weight_diff, tree_weight)
                combos += tree_combos
                pairs += tree_pairs
                rate_rows.append([label, len(spec_files), len(spec_files) * len(split_files) * len(STRATEGIES)
                                  * len(SAMPLED), _common.sci(tree_rate)])
                weight_rows.append([label, len(spec_files), len(split_files), tree_combos, tree_pairs,
                                    _common.sci(tree_weight)])
    finally:
        sys.argv = argv
    tol = 1e-12
    inputs_cases = ("every released spec of the tree x data split (their configuration-cifar10-* files: the "
                    "training-set size of every node) x strategy (--lambda-tilde-strategy 0 = serving rate, 1 = "
                    "equal) x --sampled-probability-per-layer (0.0-0.0, 0.4-0.8)")
    notes_common = [
        "Run as released: Train.__init__ (spec parsing, fractions, s_e), Train.compute_profiles, Train.aggregate "
        "(pgrads), utils.load_args (flags of their scripts-fl-3-9-17-* scripts plus --float64 and a width of 4 "
        "channels), models/resnets.py ResNetEE. Replaced in memory: the node class and the data loader (no "
        "CIFAR-10 here). Stubbed because not installed: " + (", ".join(stubbed) or "nothing") + ".",
        head_note + ".",
    ]
    if cut_files:
        notes_common.append("Not valid JSON as released (holds # comments), read here with the comments cut: "
                            + ", ".join(cut_files) + " (the *-0.05.sh scripts load it).")
    record = _common.make_record(
        STUDY, "Fed-CIS per-exit serving rates: their Train.__init__ s_e vs CISTopology.serving_rates()", "weights",
        args, REPO, FILES, inputs_cases, [], combos, rate_diff, tol, rate_diff <= tol,
        notes_common + ["Their s_e sums max(0, arrival - departure + sum of the children's departures) over the "
                        "nodes of each exit, taking the departure rate as given; the library takes min(cap, "
                        "incoming). They coincide when no cap exceeds what reaches a node, as in every released "
                        "spec."],
        table={"header": ["tree", "specs", "combinations", "max |s_e theirs - ours|"], "rows": rate_rows})
    _common.write_record(args.root, "serving-rates", record)

    record = _common.make_record(
        STUDY, "Fed-CIS per-(node, exit) weights: their aggregate() vs FedCIS.pair_weights()", "weights", args, REPO,
        FILES,
        inputs_cases + ". Each node that may train exit e moves one coordinate of its own (in block 0) by 1, the "
        "global model starts at 0, one aggregate() per exit: the coordinate is their weight Lt_e |D_c| / |D_e| "
        "p_ce; compared with FedCIS(prob_weighting='direct', p = code_sampling_matrix(...)).pair_weights()",
        [], combos, weight_diff, tol, weight_diff <= tol,
        notes_common + ["Their weight multiplies by p_ce (custom_training_topology.py: lambda_tilde_e * "
                        "c_ds_scale_factor * p_ce); Algorithm 6 and (D.11) divide by it: the library's default "
                        "prob_weighting='inverse' is the thesis, 'direct' the code. Identical at p = 0 (the Table "
                        "5.1 runs)."],
        table={"header": ["tree", "specs", "data splits", "combinations", "(node, exit) pairs", "max |theirs - ours|"],
               "rows": weight_rows},
        pairs=pairs)
    _common.write_record(args.root, "weights-pairs", record)

    for (name, base, heads), res in sorted(update.items()):
        for group in ("blocks", "heads"):
            r = res[group]
            update_rows.append([name, base, str(heads), group, _common.sci(r["moved_theirs"]),
                                _common.sci(r["moved_ours"]), _common.sci(r["max_abs_diff"])])
    blocks_diff = max(r["blocks"]["max_abs_diff"] for r in update.values())
    heads_diff = max(r["heads"]["max_abs_diff"] for (n, b, h), r in update.items() if h)
    released_diff = max(max(r["blocks"]["max_abs_diff"], r["heads"]["max_abs_diff"])
                        for (n, b, h), r in update.items() if not h)
    heads_moved = max(r["heads"]["moved_theirs"] for (n, b, h), r in update.items() if b == "literal")
    record = _common.make_record(
        STUDY, "Fed-CIS server update: their aggregate() vs FedCIS(aggregate_heads=False) (literal and root_local "
        "bases; aggregate_heads=True beside it)", "weights", args, REPO, FILES,
        "7-node tree, 80-15-5, equal data split (their configuration-...-eq.json sizes), p = 0 (every node trains "
        "its deepest exit), both strategies; a random start model and random updates (seed 0), each node changing "
        "exactly its trained sub-model (the blocks up to its exit and its exit's head). 'literal': their global "
        "model a separate object, against aggregation_base='literal'; 'root_local': their global model is node 0's "
        "model (as load_nodes_states makes it), against aggregation_base='root_local' with the library's masks; "
        "each with aggregate_heads=False (head_mask: every classifiers.* parameter), the comparison this record "
        "decides on, and aggregate_heads=True (Algorithm 6 as written) beside it",
        [0], sum(1 for (n, b, h) in update if not h), released_diff, tol, released_diff <= tol,
        notes_common + [
            f"aggregate_heads=False (what their aggregate() does) agrees, blocks and heads, both bases and both "
            f"strategies: max difference {_common.sci(released_diff)}.",
            f"With aggregate_heads=True the blocks agree (max difference {_common.sci(blocks_diff)}) and the exits' "
            f"heads do not ({_common.sci(heads_diff)}): their aggregate() accumulates exit e's head difference in "
            "w_diff.classifiers[e_block - 1] but, when it updates the global model, adds "
            "w_diff.classifiers[block] for `block in layers_per_classifier` (block = 3 and 9; 17 is past the "
            "last block), heads that received nothing. So no head is ever aggregated: with a separate global "
            f"model the heads do not move (largest move {_common.sci(heads_moved)}); in their runs, where the "
            "global model is node 0's, every exit's head is the root's own (trained only when the root draws that "
            "exit: never at p = 0 for exits 1 and 2). aggregate_heads=True aggregates the heads inside the exit "
            "masks instead, as Algorithm 6 line 11 writes; the Fed-CIS study's v1 and v2 ran it under the name "
            "'released code', its v3 runs both.",
            "Their aggregate() also averages BatchNorm running statistics with the same weights; the library's "
            "rule sees parameters only (its server averages buffers separately), so buffers are not compared."],
        table={"header": ["strategy", "base", "aggregate_heads (ours)", "parameters", "largest move (theirs)",
                          "largest move (ours)", "max |theirs - ours|"], "rows": update_rows})
    _common.write_record(args.root, "server-update", record)

    record = _common.make_record(
        STUDY, "Fed-CIS accuracy: the authors' training loop vs the library's", "accuracy", args, REPO,
        ["main.py", "fedclients/aggregator.py", "dataloaders/dataloader.py"], "not run", [], 0, None, None, None,
        ["Not run here: main.py calls torch.cuda.current_device() before anything else (it needs a CUDA device), "
         "its loaders need CIFAR-10 (not on this machine, no network), and it needs loguru, alive-progress, "
         "fvcore and pandas (not installed). Its recipe is GPU work: per round every node trains "
         "round(local_epochs x |D_root| / |D_n|) local epochs (main.py) of a 64-channel ResNet-18-style network "
         "with batches of 128 (15,000 root images: ~117 batches per epoch), and every node is evaluated every "
         "round, for 100 rounds."],
        status="not run")
    _common.write_record(args.root, "accuracy-fedcis", record)


if __name__ == "__main__":
    main()
