"""PyTorch's own module_db batch-norm inputs, run through synchronized gloo worlds.

``torch.testing._internal.common_modules`` lists the constructor arguments and inputs PyTorch tests its
``nn.BatchNorm1d/2d/3d`` on (``module_inputs_torch_nn_BatchNorm{1,2,3}d``): a cumulative average
(``momentum=None``), ``affine=False``, ``bias=False``, ``track_running_stats=False``, 3D inputs to
BatchNorm1d, empty batches. Porting them here checks distsync on the configurations PyTorch itself
guarantees, rather than on ones we picked. Each global batch is split unevenly over 2 or 3 ranks (one
rank with a single sample, the others empty, then everything on the last rank), and the layer made by
``convert_sync_batchnorm`` must equal float64 ``nn.BatchNorm*`` on the whole batch: outputs, input grads,
the per-rank parameter grads summed over ranks (as with ``nn.SyncBatchNorm``), the buffers after each of
two training steps, and an eval-mode forward afterwards.

Importing ``common_modules`` takes seconds and changes global torch flags, so the inputs are copied below
from torch 2.13.0, and ``test_port_matches_module_db`` checks the copy against module_db in a subprocess
(``expecttest``, which that import needs, is in the test extra). Weight and bias are randomized after
construction (module_db keeps the default 1 and 0), so that a parameter used in the wrong place cannot
hide.
"""

import ast
import copy
import functools
import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.testing import make_tensor

import distsync
from distsync.testing import run_world

# (class, desc, constructor args, constructor kwargs, forward input shape), in module_db's order.
MODULE_DB = [
    ("BatchNorm1d", "affine", (10,), {}, (4, 10)),
    ("BatchNorm1d", "3d_input", (5,), {}, (4, 5, 3)),
    ("BatchNorm1d", "affine_simple_average", (10, 1e-3, None), {}, (4, 10)),
    ("BatchNorm1d", "not_affine", (10, 1e-3, 0.3, False), {}, (4, 10)),
    ("BatchNorm1d", "not_tracking_stats", (10, 1e-3, 0.3, True, False), {}, (4, 10)),
    ("BatchNorm1d", "3d_input_not_affine", (5, 1e-3, 0.3, False), {}, (4, 5, 3)),
    ("BatchNorm1d", "zero_batch", (5, 1e-3, 0.3, False), {}, (0, 5, 9)),
    ("BatchNorm1d", "affine_not_bias", (10,), {"bias": False}, (4, 10)),
    ("BatchNorm2d", "", (3,), {}, (2, 3, 6, 6)),
    ("BatchNorm2d", "2d_simple_average", (3, 1e-3, None), {}, (2, 3, 6, 6)),
    ("BatchNorm2d", "momentum", (3, 1e-3, 0.8), {}, (2, 3, 6, 6)),
    ("BatchNorm2d", "not_affine", (3, 1e-3, 0.8, False), {}, (2, 3, 6, 6)),
    ("BatchNorm2d", "not_tracking_stats", (3, 1e-3, 0.8, True, False), {}, (2, 3, 6, 6)),
    ("BatchNorm2d", "zero_batch", (5, 1e-3, 0.3, False), {}, (0, 5, 2, 2)),
    ("BatchNorm2d", "affine_not_bias", (3,), {"bias": False}, (2, 3, 6, 6)),
    ("BatchNorm3d", "", (3,), {}, (2, 3, 4, 4, 4)),
    ("BatchNorm3d", "3d_simple_average", (3, 1e-3, None), {}, (2, 3, 4, 4, 4)),
    ("BatchNorm3d", "momentum", (3, 1e-3, 0.7), {}, (2, 3, 4, 4, 4)),
    ("BatchNorm3d", "not_affine", (3, 1e-3, 0.7, False), {}, (2, 3, 4, 4, 4)),
    ("BatchNorm3d", "not_tracking_stats", (3, 1e-3, 0.7, True, False), {}, (2, 3, 4, 4, 4)),
    ("BatchNorm3d", "zero_batch", (5, 1e-3, 0.3, False), {}, (0, 5, 2, 2, 2)),
    ("BatchNorm3d", "affine_not_bias", (3,), {"bias": False}, (2, 3, 4, 4, 4)),
]
# nn.BatchNorm takes bias=False from torch 2.12 on: earlier releases' module_db has no such case.
if "bias" not in inspect.signature(nn.BatchNorm1d.__init__).parameters:
    MODULE_DB = [case for case in MODULE_DB if "bias" not in case[3]]
RTOL = 1e-10  # relative to the reference's norm; float64 throughout


def splits(n: int, world_size: int) -> list[list[int]]:
    """Per-rank batch sizes of the training steps: [n-1, 1, 0, ...] then [0, ..., 0, n]."""
    first = [max(n - 1, 0), min(n, 1)] + [0] * (world_size - 2)
    return [first, [0] * (world_size - 1) + [n]]


def make_case(index: int, world_size: int) -> dict:
    """One module_db input: the initialized reference layer, the training steps' data and an eval input."""
    cls_name, desc, args, kwargs, shape = MODULE_DB[index]
    with torch.random.fork_rng():
        torch.manual_seed(index)
        reference = getattr(nn, cls_name)(*args, **kwargs).double()
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(torch.rand_like(param) + 0.5 if name == "weight" else torch.randn_like(param))
        data = functools.partial(make_tensor, shape, dtype=torch.float64, device="cpu")  # as module_db's
        steps = [(data(), torch.randn(shape, dtype=torch.float64), s) for s in splits(shape[0], world_size)]
        eval_input = data()
    return {
        "id": f"{cls_name}[{desc or 'default'}]",
        "reference": reference,
        "steps": steps,
        "eval": eval_input,
    }


def snapshot(layer: nn.Module, output: torch.Tensor, input_grad: torch.Tensor | None) -> dict:
    return {
        "output": output.detach().clone(),
        "input_grad": input_grad,
        "grads": {name: param.grad for name, param in layer.named_parameters()},
        "buffers": {name: buffer.clone() for name, buffer in layer.named_buffers()},
    }


def run_layer(layer: nn.Module, case: dict, rank: int | None) -> dict:
    """Training steps on this rank's share of each batch (the whole batch for ``rank=None``), then eval.

    Stops at the first exception and records it as ``error``.
    """
    result = {"class": type(layer).__name__, "steps": [], "error": None}
    try:
        for x, dy, sizes in case["steps"]:
            begin = 0 if rank is None else sum(sizes[:rank])
            share = slice(None) if rank is None else slice(begin, begin + sizes[rank])
            layer.train()
            layer.zero_grad(set_to_none=True)
            x = x[share].clone().requires_grad_()
            output = layer(x)
            output.backward(dy[share])
            result["steps"].append(snapshot(layer, output, x.grad))
        layer.eval()
        with torch.no_grad():
            result["eval"] = layer(case["eval"])
    except Exception as error:  # reported per case by the test
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def _run_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    layers = [distsync.convert_sync_batchnorm(copy.deepcopy(case["reference"])) for case in cases]
    return [run_layer(layer, case, rank) for layer, case in zip(layers, cases, strict=True)]


def mismatch(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None) -> str | None:
    """Why ``actual`` differs from ``expected`` (relative error above RTOL, shapes, None), or None."""
    if actual is None or expected is None:
        return None if actual is expected else f"{name}: got {actual} expected {expected}"
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        got, want = f"{actual.dtype} {list(actual.shape)}", f"{expected.dtype} {list(expected.shape)}"
        return f"{name}: got {got}, expected {want}"
    if not expected.is_floating_point():
        return None if torch.equal(actual, expected) else f"{name}: got {actual} expected {expected}"
    if expected.numel() == 0:
        return None
    error = (actual - expected).norm().item() / max(expected.norm().item(), 1e-300)
    return None if error <= RTOL else f"{name}: relative error {error:.3g}"


def rank_problems(got: dict, want: dict, step_sizes: list[list[int]], rank: int) -> list[str]:
    """Per-rank comparisons: output and input grad shares, buffers, eval output."""
    problems = []
    for step, (g, w, sizes) in enumerate(zip(got["steps"], want["steps"], step_sizes, strict=True)):
        share = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        where = f"rank {rank} step {step} sizes={sizes}"
        problems.append(mismatch(f"{where} output", g["output"], w["output"][share]))
        problems.append(mismatch(f"{where} input grad", g["input_grad"], w["input_grad"][share]))
        for name, buffer in w["buffers"].items():
            problems.append(mismatch(f"{where} {name}", g["buffers"].get(name), buffer))
    problems.append(mismatch(f"rank {rank} eval output", got["eval"], want["eval"]))
    return problems


def case_problems(per_rank: list[dict], want: dict, case: dict, cls_name: str) -> list[str]:
    """Everything wrong with one case across ranks (the reference ``want`` ran on the whole batch)."""
    if want["error"] is not None:  # nn.BatchNorm refuses the input: every rank must raise ValueError too
        refused = [str(got["error"]).startswith("ValueError") for got in per_rank]
        return [] if all(refused) else [f"nn.BatchNorm raised {want['error']}, ranks: {per_rank}"]
    errors = [f"rank {r} raised {got['error']}" for r, got in enumerate(per_rank) if got["error"]]
    if errors:
        return errors
    step_sizes = [sizes for _, _, sizes in case["steps"]]
    problems = [f"converted to {got['class']}" for got in per_rank if got["class"] != f"DistSync{cls_name}"]
    for rank, got in enumerate(per_rank):
        problems += rank_problems(got, want, step_sizes, rank)
    for step, w in enumerate(want["steps"]):
        for name, expected in w["grads"].items():
            grads = [got["steps"][step]["grads"][name] for got in per_rank]
            total = None if None in grads else torch.stack(grads).sum(0)
            problems.append(mismatch(f"step {step} {name} grad summed over ranks", total, expected))
    return [problem for problem in problems if problem]


@pytest.mark.parametrize("world_size", [2, 3])
def test_module_db_inputs_match_batchnorm_on_global_batch(world_size):
    cases = [make_case(index, world_size) for index in range(len(MODULE_DB))]
    per_rank = run_world(_run_cases, world_size, cases)
    failures = []
    for index, case in enumerate(cases):
        want = run_layer(copy.deepcopy(case["reference"]), case, rank=None)
        problems = case_problems([results[index] for results in per_rank], want, case, MODULE_DB[index][0])
        failures += [f"{case['id']} world_size={world_size}: {problem}" for problem in problems]
    assert not failures, "\n".join(failures)


_LIST_MODULE_DB = """
import torch
from torch.testing._internal.common_modules import module_db
found = []
for info in module_db:
    if info.module_cls in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d):
        for mi in info.module_inputs_func(info, "cpu", torch.float64, requires_grad=True, training=True):
            shapes = [tuple(arg.shape) for arg in mi.forward_input.args]
            found.append((info.module_cls.__name__, mi.desc, mi.constructor_input.args,
                          mi.constructor_input.kwargs, shapes, mi.forward_input.kwargs))
print(repr(found))
"""


def test_port_matches_module_db():
    """The copied inputs are still module_db's (run in a subprocess: the import changes global flags)."""
    proc = subprocess.run(
        [sys.executable, "-c", _LIST_MODULE_DB], capture_output=True, text=True, timeout=120, check=True
    )
    found = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert found == [(c, d, a, k, [shape], {}) for c, d, a, k, shape in MODULE_DB]
