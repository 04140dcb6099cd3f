"""The native CPU kernels' codes (the enums of ``ops/csrc/tbe_cpu.h`` and
``tbe_cpu_backward.c``) against the Python tables they must equal: pooling
(``pooling.PoolingMode``), optimizers (``optim.KERNEL_CODES``, the names in
``cpu_native.NATIVE_OPTIMIZERS``) and the hyper-parameter slots (``optim.NATIVE_HYPER_FIELDS``);
and no bare codes where a name exists."""

import pathlib
import re

from fbtriton_dist import optim
from fbtriton_dist.ops import cpu_native
from fbtriton_dist.pooling import PoolingMode

PKG = pathlib.Path(__file__).resolve().parents[2] / "fbtriton_dist"
HEADER = PKG / "ops" / "csrc" / "tbe_cpu.h"
BACKWARD = PKG / "ops" / "csrc" / "tbe_cpu_backward.c"


def header_enums(text: str) -> dict[str, int]:
    """Every ``NAME = value`` of the header's ``enum { ... }`` blocks (comments dropped)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out = {}
    for body in re.findall(r"enum\s*\{(.*?)\}", text, flags=re.S):
        for name, value in re.findall(r"([A-Z][A-Z0-9_]*)\s*=\s*(-?\d+)", body):
            out[name] = int(value)
    return out


def with_prefix(enums: dict[str, int], prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): v for k, v in enums.items() if k.startswith(prefix)}


def test_parser_reads_enums():
    text = "/* OPT_X = 9 */\nenum { A_ONE = 1, A_TWO = 2,\n B = 3 };\nenum { C = 4 }; // D = 5"
    assert header_enums(text) == {"A_ONE": 1, "A_TWO": 2, "B": 3, "C": 4}


def test_pooling_codes_match_pooling_mode():
    pools = with_prefix(header_enums(HEADER.read_text()), "POOL_")
    assert pools == {m.name: int(m) for m in PoolingMode}


def test_optimizer_codes_come_from_the_registry():
    assert not with_prefix(header_enums(HEADER.read_text()), "OPT_")  # one place only
    opts = with_prefix(header_enums(BACKWARD.read_text()), "OPT_")
    assert opts.pop("NONE") == optim.NO_OPTIMIZER_CODE
    # every OPT_<NAME> of the C side is a registry optimizer with the registry's code, and
    # exactly those are the ones the CPU backend says the native kernels implement
    assert {k.lower(): v for k, v in opts.items()} == {
        name: optim.KERNEL_CODES[name] for name in cpu_native.NATIVE_OPTIMIZERS
    }
    assert cpu_native.OPT_CODES == {k.lower(): v for k, v in opts.items()}


def test_hyper_slots_match_native_hyper_fields():
    slots = with_prefix(header_enums(BACKWARD.read_text()), "HYPER_")
    count = slots.pop("COUNT")
    assert count == len(optim.NATIVE_HYPER_FIELDS)
    assert sorted(slots, key=slots.get) == [f.upper() for f in optim.NATIVE_HYPER_FIELDS]
    assert sorted(slots.values()) == list(range(count))


def test_native_hyper_parameters_layout():
    opt = optim.RowWiseAdagrad(lr=0.5, eps=1e-3, weight_decay=0.25, weight_decay_mode="decoupled")
    values = dict(zip(optim.NATIVE_HYPER_FIELDS, optim.native_hyper_parameters(opt, 7),
                      strict=True))
    assert values == {"lr": 0.5, "eps": 1e-3, "beta1": 0.0, "beta2": 0.0, "weight_decay": 0.25,
                      "decoupled": 1.0, "step": 7.0}
    adam = dict(zip(optim.NATIVE_HYPER_FIELDS, optim.native_hyper_parameters(
        optim.Adam(betas=(0.5, 0.75)), 2), strict=True))
    assert (adam["beta1"], adam["beta2"], adam["decoupled"]) == (0.5, 0.75, 0.0)


def test_no_bare_codes():
    """The C code indexes ``hyper`` by slot name; the kernels compare pooling by the enum."""
    for path in (PKG / "ops" / "csrc").glob("*.c"):
        assert not re.findall(r"hyper\[\d\]", path.read_text()), path
    for path in [*(PKG / "kernels").glob("*.py"), *(PKG / "reference").glob("*.py"),
                 *(PKG / "ops").glob("*.py")]:
        bare = re.findall(r"(?i)\bpooling\s*[!=]=\s*\d", path.read_text())
        assert not bare, (path, bare)
