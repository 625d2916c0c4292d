"""Model zoo: early-exit ResNet-18 (Fed-CIS layout), timm exits, the papers' small CNNs, EarlyExitClassifier."""

from __future__ import annotations

import pytest
import torch
import torchvision
from lightning_fedhet.model_zoo import (
    EarlyExitNet,
    create,
    early_exit_resnet18,
    list_models,
)

from lightning_fedhet.early_exit_module import EarlyExitClassifier

torch.set_num_threads(1)


def _numel(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _small(**kw) -> EarlyExitNet:
    torch.manual_seed(0)
    kw.setdefault("base_width", 8)
    return early_exit_resnet18(**kw)


# ---------------------------------------------------------------- ResNet-18 structure
def test_resnet_shapes_and_exit_count():
    net = _small(num_classes=10)
    out = net(torch.randn(2, 3, 8, 8))
    assert net.num_exits == 3 and len(out) == 3
    assert net.exit_blocks == (3, 9, 17) and len(net.blocks) == 17
    assert all(o.shape == (2, 10) for o in out)
    # listing the final block is the same model
    assert _small(num_classes=10, exits=(3, 9, 17)).exit_blocks == (3, 9, 17)
    # CIFAR100 layout and one exit only
    assert _small(num_classes=100, exits=(9, 13)).exit_blocks == (9, 13, 17)
    assert _small(exits=()).num_exits == 1
    # stride layouts: thesis (1,1,2,2) keeps 8x8 through stage 2, standard halves it
    feats = {}
    for layout in ("thesis", "standard"):
        net = _small(stride_layout=layout)
        x = torch.randn(1, 3, 8, 8)
        for b in net.blocks[:9]:
            x = b(x)
        feats[layout] = tuple(x.shape)
    assert feats == {"thesis": (1, 16, 8, 8), "standard": (1, 16, 4, 4)}


def test_group_norm_variant_has_no_batchnorm():
    net = _small(norm="group")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    gns = [m for m in net.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert gns and all(m.num_groups == 2 for m in gns)
    assert [o.shape for o in net(torch.randn(2, 3, 8, 8))] == [torch.Size([2, 10])] * 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(exits=(9, 3)), r"exits.*\[1, 17\]"),
        (dict(exits=(3, 3)), r"exits.*\[1, 17\]"),
        (dict(exits=(0, 9)), r"exits.*\[1, 17\]"),
        (dict(exits=(3, 18)), r"exits.*\[1, 17\]"),
        (dict(exits=(3.0, 9)), r"exits.*\[1, 17\]"),
        (dict(stride_layout="wide"), "stride_layout"),
        (dict(norm="layer"), "norm"),
        (dict(num_classes=0), "num_classes"),
        (dict(in_channels=0), "in_channels"),
    ],
)
def test_resnet_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        early_exit_resnet18(**{"base_width": 8, **kwargs})


def test_truncate_shares_parameters_and_matches_full_logits():
    net = _small(num_classes=5).eval()
    x = torch.randn(3, 3, 8, 8)
    full = net(x)
    full_state = net.state_dict()
    for e in (1, 2, 3):
        sub = net.truncate(e)
        assert isinstance(sub, EarlyExitNet) and sub.num_exits == e
        assert len(sub.blocks) == net.exit_blocks[e - 1]  # only the prefix of blocks is held
        # same tensors (shared, not copied) under the same state_dict keys
        sub_state = sub.state_dict(keep_vars=True)
        assert set(sub_state) <= set(full_state)
        assert all(v is net.state_dict(keep_vars=True)[k] for k, v in sub_state.items())
        deeper = {id(p) for b in net.blocks[net.exit_blocks[e - 1] :] for p in b.parameters()}
        deeper |= {id(p) for h in net.heads[e:] for p in h.parameters()}
        assert not deeper & {id(p) for p in sub.parameters()}
        # identical logits to the full net's first e exits, and to forward(upto=e)
        out = sub(x)
        assert len(out) == e
        for a, b in zip(out, full[:e]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(net(x, upto=e), full[:e]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # an update through the sub-model is an update of the full model
    sub = net.truncate(1)
    with torch.no_grad():
        sub.heads[0].fc.bias.add_(1.0)
    torch.testing.assert_close(net(x)[0], full[0] + 1.0)
    with pytest.raises(ValueError, match=r"e must be an exit index in \[1, 3\]"):
        net.truncate(0)
    with pytest.raises(ValueError, match="e must be"):
        net.truncate(4)
    with pytest.raises(ValueError, match="upto"):
        net(x, upto=4)


def test_resnet18_parameter_counts_match_torchvision():
    """Backbone blocks 2..17 = torchvision resnet18 layer1..layer4 (same shapes: strides do not change parameters).

    The stem differs by design: CIFAR 3x3 conv (3*64*9 = 1,728) + BN (2*64) instead of torchvision's 7x7 conv
    (3*64*49 = 9,408) + BN. Heads: Linear(64->10), Linear(128->10), Linear(512->10).
    """
    torch.manual_seed(0)
    net = early_exit_resnet18(num_classes=10, exits=(3, 9))
    tv = torchvision.models.resnet18(num_classes=10)
    assert _numel(net.blocks[1:]) == _numel([tv.layer1, tv.layer2, tv.layer3, tv.layer4]) == 11_166_976
    # per BasicBlock: our L + U entries = torchvision's BasicBlock
    tv_blocks = [b for layer in (tv.layer1, tv.layer2, tv.layer3, tv.layer4) for b in layer]
    for k, tvb in enumerate(tv_blocks):
        assert _numel(net.blocks[1 + 2 * k : 3 + 2 * k]) == _numel([tvb])
    assert _numel([net.blocks[0]]) == 3 * 64 * 9 + 2 * 64 == _numel([tv.conv1, tv.bn1]) - 3 * 64 * (49 - 9)
    assert [_numel([h]) for h in net.heads] == [64 * 10 + 10, 128 * 10 + 10, 512 * 10 + 10]
    assert sum(p.numel() for p in net.parameters()) == 1_856 + 11_166_976 + 650 + 1_290 + 5_130 == 11_175_902
    # exit e depends on blocks up to exit e + head e (not the shallower heads):
    # BasicBlock(64->64) = 2*36,864 + 2*128 = 73,984; stage 2 = (73,728 + 256 + 147,456 + 256 + 8,192 + 256)
    # + (2*147,456 + 2*256) = 525,568
    assert net.exit_params() == [
        1_856 + 73_984 + 650,
        1_856 + 2 * 73_984 + 525_568 + 1_290,
        11_175_902 - 650 - 1_290,
    ]


def test_exit_flops_hand_count_and_monotone():
    """MACs of conv + linear layers for one 3x16x16 sample (thesis strides 1,1,2,2).

    At 32x32 the backbone costs (spec §2.6 hand count): stem 32*32*64*27 = 1,769,472; stage 1 (64 ch, 32x32)
    4 * 32*32*64*64*9 = 150,994,944; stages 2-4 each 536,870,912 (incl. the 1x1 shortcut); total 1,763,377,152.
    At 16x16 every conv costs a quarter; heads cost in_features * 10 regardless of resolution.
    Exit 1 (block 3) = (1,769,472 + 2*37,748,736)/4 + 640 = 19,316,736 + 640.
    Exit 2 (block 9) = (1,769,472 + 150,994,944 + 536,870,912)/4 + 1,280 = 172,408,832 + 1,280.
    Exit 3 (block 17) = 1,763,377,152/4 + 5,120 = 440,844,288 + 5,120.
    """
    net = early_exit_resnet18(num_classes=10, exits=(3, 9))
    net.train()
    flops = net.exit_flops((3, 16, 16))
    assert net.training  # mode restored
    assert flops == [19_316_736 + 640, 172_408_832 + 1_280, 440_844_288 + 5_120]
    assert flops == sorted(flops)
    # relative cost at blocks 3/9/13/17 as in the spec (≈0.044/0.391/0.696 thesis, ≈0.139/0.517/0.758 standard)
    for layout, ratios in (("thesis", (0.044, 0.391, 0.696)), ("standard", (0.139, 0.517, 0.758))):
        f = early_exit_resnet18(num_classes=10, exits=(3, 9, 13), stride_layout=layout).exit_flops((3, 16, 16))
        assert [round(a / f[-1], 3) for a in f[:3]] == pytest.approx(ratios, abs=1.5e-3)
    with pytest.raises(ValueError, match="input_shape"):
        net.exit_flops((3, 0, 16))


# ---------------------------------------------------------------- registry and small CNNs
def test_registry_names():
    names = set(list_models())
    expected = {
        "ee_resnet18", "ee_resnet18_cifar10", "ee_resnet18_cifar100", "ee_resnet18_fmnist", "timm_early_exit",
        "fedau_cnn_cifar10", "fedau_cnn_svhn", "fedau_cnn_cifar100", "fedau_cnn_cinic10", "lenet5_fmnist",
        "fedast_cnn_cifar10", "fedast_mlp_mnist", "mnist_cnn", "fmnist_cnn", "logistic_regression",
    }  # fmt: skip
    assert expected <= names
    c100 = create("ee_resnet18_cifar100", base_width=8)
    assert c100.exit_blocks == (9, 13, 17)
    assert [o.shape for o in c100(torch.randn(2, 3, 8, 8))] == [torch.Size([2, 100])] * 3
    fm = create("ee_resnet18_fmnist", base_width=8)
    assert fm.blocks[0].conv.in_channels == 1 and fm.exit_blocks == (3, 9, 17)
    assert [o.shape for o in fm(torch.randn(2, 1, 12, 12))] == [torch.Size([2, 10])] * 3
    assert create("ee_resnet18_cifar10", base_width=8).exit_blocks == (3, 9, 17)


@pytest.mark.parametrize(
    "name, params, shape",
    [
        # conv 3*32*9+32 = 896, conv 32*32*9+32 = 9,248, fc 2048*256+256, 256*64+64, 64*10+10
        ("fedau_cnn_cifar10", 896 + 9_248 + 524_544 + 16_448 + 650, (3, 32, 32)),
        ("fedau_cnn_svhn", 273_706, (3, 32, 32)),
        ("fedau_cnn_cifar100", 1_216_260, (3, 32, 32)),
        ("fedau_cnn_cinic10", 1_193_130, (3, 32, 32)),
        # 6*25+6, 16*6*25+16, 256*120+120, 120*84+84, 84*10+10
        ("lenet5_fmnist", 156 + 2_416 + 30_840 + 10_164 + 850, (1, 28, 28)),
        # 3*64*25+64, 64*64*25+64, 1600*384+384, 384*192+192, 192*10+10
        ("fedast_cnn_cifar10", 4_864 + 102_464 + 614_784 + 73_920 + 1_930, (3, 32, 32)),
        ("fedast_mlp_mnist", 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10, (1, 28, 28)),
    ],
)
def test_small_models(name, params, shape):
    torch.manual_seed(0)
    m = create(name)
    assert sum(p.numel() for p in m.parameters()) == params
    out = m(torch.randn(2, *shape))
    n_cls = 100 if name.endswith("cifar100") else 10
    assert out.shape == (2, n_cls)


# every registered name, with the smallest input it takes and the kwargs that keep it small
_ZOO_INPUTS = {
    "ee_resnet18": ({"base_width": 8}, (3, 8, 8)),
    "ee_resnet18_cifar10": ({"base_width": 8}, (3, 8, 8)),
    "ee_resnet18_cifar100": ({"base_width": 8}, (3, 8, 8)),
    "ee_resnet18_fmnist": ({"base_width": 8}, (1, 12, 12)),
    "timm_early_exit": ({"backbone": "test_resnet", "exits": (0, 3), "num_classes": 4}, (3, 16, 16)),
    "fedau_cnn_cifar10": ({}, (3, 32, 32)),
    "fedau_cnn_svhn": ({}, (3, 32, 32)),
    "fedau_cnn_cifar100": ({}, (3, 32, 32)),
    "fedau_cnn_cinic10": ({}, (3, 32, 32)),
    "lenet5_fmnist": ({}, (1, 28, 28)),
    "fedast_cnn_cifar10": ({}, (3, 32, 32)),
    "fedast_mlp_mnist": ({}, (1, 28, 28)),
    "mnist_cnn": ({}, (1, 28, 28)),
    "fmnist_cnn": ({}, (1, 28, 28)),
    "logistic_regression": ({}, (60,)),
}


def test_zoo_inputs_cover_the_registry():
    assert set(_ZOO_INPUTS) == set(list_models())


@pytest.mark.parametrize("name", sorted(_ZOO_INPUTS))
def test_every_output_is_the_raw_output_of_a_linear_layer(name):
    # Logits must leave the model straight from a Linear layer: no ReLU (or anything else) after it. A ReLU on the
    # logits (the FedAST authors' LeNet-5) clips negative logits to 0 and kills the gradient of a class whose
    # logit is negative. Check: every output tensor is, element for element, the output of the last Linear call
    # that produced a tensor of its shape, and some logit is negative on random inputs.
    # Slip caught: an nn.ReLU / activation appended after the last Linear in any model of the zoo.
    kwargs, shape = _ZOO_INPUTS[name]
    torch.manual_seed(0)
    model = create(name, **kwargs).eval()
    linear_outputs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: linear_outputs.append(out))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        out = model(torch.randn(4, *shape))
    for h in hooks:
        h.remove()
    outputs = out if isinstance(out, (list, tuple)) else [out]
    for logits in outputs:
        assert any(lin.shape == logits.shape and torch.equal(lin, logits) for lin in linear_outputs), name
        assert (logits < 0).any(), name


def test_fedau_cnn_init():
    m = create("fedau_cnn_cifar10")
    convs = [x for x in m.modules() if isinstance(x, (torch.nn.Conv2d, torch.nn.Linear))]
    assert all((c.bias == 0).all() for c in convs[:-1])  # Kaiming weights, zero biases except the last layer
    assert not (convs[-1].bias == 0).all()


# ---------------------------------------------------------------- timm
def test_from_timm_shapes_truncate_and_errors():
    torch.manual_seed(0)
    net = EarlyExitNet.from_timm("test_resnet", exits=(1, 2, 4), num_classes=5).eval()
    x = torch.randn(2, 3, 16, 16)
    out = net(x)
    assert net.num_exits == 3 and [o.shape for o in out] == [torch.Size([2, 5])] * 3
    sub = net.truncate(2)
    # sequential feature wrapper: the sub-model holds and runs only the modules up to stage 2
    assert len(sub.blocks) < len(net.blocks)
    assert {id(p) for p in sub.parameters()} < {id(p) for p in net.parameters()}
    for a, b in zip(sub(x), out[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    flops = net.exit_flops((3, 16, 16))
    assert flops == sorted(flops) and flops[0] > 0
    assert net.exit_params() == sorted(net.exit_params())
    with pytest.raises(ValueError, match=r"exits.*\[0, 4\]"):
        EarlyExitNet.from_timm("test_resnet", exits=(1, 9))
    with pytest.raises(ValueError, match="exits"):
        EarlyExitNet.from_timm("test_resnet", exits=(2, 1))
    reg = create("timm_early_exit", backbone="test_resnet", exits=(0, 3), num_classes=4)
    assert [o.shape for o in reg(x)] == [torch.Size([2, 4])] * 2


def test_from_timm_non_sequential_backbone():
    """ViT features come from forward_intermediates: one block computes all stages; truncate keeps exits 1..e."""
    torch.manual_seed(0)
    net = EarlyExitNet.from_timm("test_vit", exits=(1, 3), num_classes=4, img_size=16).eval()
    x = torch.randn(2, 3, 16, 16)
    out = net(x)
    assert net.exit_blocks == (1, 1) and [o.shape for o in out] == [torch.Size([2, 4])] * 2
    sub = net.truncate(1)
    assert sub.num_exits == 1
    torch.testing.assert_close(sub(x)[0], out[0], rtol=0, atol=0)


# ---------------------------------------------------------------- EarlyExitClassifier
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("train_exit", [1, 2, 3, None])
def test_classifier_trains_only_the_prefix_of_its_exit(train_exit):
    net = _small(num_classes=4)
    module = EarlyExitClassifier(net, num_classes=4, train_exit=train_exit, lr=0.1, momentum=0.9, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = module.configure_optimizers()
    opt.zero_grad()
    module.training_step(batch, 0).backward()
    e = train_exit or net.num_exits
    last = net.exit_blocks[e - 1]
    prefix = {id(p) for b in net.blocks[:last] for p in b.parameters()} | {id(p) for p in net.heads[e - 1].parameters()}
    for name, p in net.named_parameters():
        if id(p) in prefix:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        elif train_exit is not None:  # deeper blocks/heads and shallower heads: no gradient at all
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
    opt.step()
    for name, p in net.named_parameters():
        moved = not torch.equal(p.detach(), before[name])
        assert moved == (id(p) in prefix or train_exit is None), name


def test_classifier_settings_and_errors():
    net = _small(num_classes=4)
    module = EarlyExitClassifier(net, num_classes=4)
    assert module.train_exit is None and module.exit_weights.tolist() == pytest.approx([1 / 3] * 3)
    module.set_train_exit(2)
    assert module.train_exit == 2
    module.set_train_exit(None)
    with pytest.raises(ValueError, match="train_exit"):
        module.set_train_exit(4)
    with pytest.raises(ValueError, match="train_exit"):
        EarlyExitClassifier(net, num_classes=4, train_exit=0)
    with pytest.raises(ValueError, match="exit_weights"):
        EarlyExitClassifier(net, num_classes=4, exit_weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="model"):
        EarlyExitClassifier(torch.nn.Linear(2, 2), num_classes=2)
    # weighted multi-exit loss = sum_e w_e CE_e
    m = EarlyExitClassifier(net, num_classes=4, exit_weights=[0.5, 0.0, 2.0])
    batch = (torch.randn(2, 3, 8, 8), torch.tensor([0, 3]))
    loss, losses = m.exit_losses(batch)
    torch.testing.assert_close(loss, 0.5 * losses[0] + 2.0 * losses[2])
    assert isinstance(
        EarlyExitClassifier("ee_resnet18_cifar10", num_classes=3, model_kwargs={"base_width": 4}).model, EarlyExitNet
    )
