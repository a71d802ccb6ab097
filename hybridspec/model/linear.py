"""Linear layers for small-batch inference on a CPU. A float32 product of up to eight rows runs this package's kernel
(`product_kernel.h`: it streams the weight at the memory's speed, each output computed alone, so bitwise the same for
any row count), the weight in bfloat16 or float16 where every value is one (`compact_weights`: half the bytes, the same
bits); any other runs the kernel and the row count that this machine multiplies fastest, measured once per
machine (`tune_products`): MKL's product on the plain weight or oneDNN's on a weight packed once, the input padded
with zero rows where a few more rows run faster than n; or, for a weight of bfloat16 values on a CPU with AMX, AMX's
tiles (`amx_product`, float32's accuracy). `pack_linears` swaps them into any module (the drafters)."""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from hybridspec.model.machine import work_clock

try:  # the small-row product kernel (built with the package; AVX-512 CPUs)
    from hybridspec.model import _products
except ImportError:  # pragma: no cover - a build without it: oneDNN's and MKL's products throughout
    _products = None
# the most rows a float32 product runs by the kernel (a step's 1 + draft tokens; a longer prompt chunk runs oneDNN's)
KERNEL_ROWS = _products.MAX_ROWS if _products is not None and _products.supported() else 0
# the narrower formats the kernel streams a weight in, where they hold its every value
COMPACT_FORMATS = ((torch.bfloat16, _products.WEIGHT_BF16), (torch.float16, _products.WEIGHT_F16)) \
    if KERNEL_ROWS else ()
WEIGHT_F32 = _products.WEIGHT_F32 if _products is not None else 0  # the kernel's name for a float32 weight
# prompt chunks of a weight of bfloat16 values on AMX tiles (`amx_kernel.h`) where this CPU has them
AMX = bool(KERNEL_ROWS) and _products.amx_supported()
EXACT_CHECK_ELEMENTS = 1 << 24  # values compared at a time by `compact_weights`: bounded memory

PLANNED_ROWS = 8   # row counts a plan covers; more rows run oneDNN's product as they are
MKL_ROWS = 4       # row counts MKL's product is timed at (it repacks the weight on every call above a few rows)
PAD_MARGIN = 1.03  # padding must beat the unpadded product by this much: a gain within the timing noise is not one
PLAN_VERSION = 2   # bump when what a plan means or how it is timed changes: older cached plans are measured again
PLANS_FILE = f"product_plans_v{PLAN_VERSION}.json"  # in the user cache, per machine

Route = tuple[bool, int]  # (MKL's product on the plain weight, rows after padding)


def _onednn_available(weight: torch.Tensor) -> bool:
    # oneDNN packs a bfloat16 weight only on CPUs with AVX-512 (BW at least); elsewhere F.linear multiplies it
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (weight.dtype == torch.float32 or _onednn_packs_bf16()))


@functools.cache
def _onednn_packs_bf16() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def untuned_routes(plain_max_rows: int = 3) -> tuple[Route, ...]:
    """The rule before any measurement (right on Intel Xeons, where MKL's product streams a weight fastest for up to
    three rows): MKL's product for up to `plain_max_rows` rows, oneDNN's for more, no padding. Index n: the route of n
    rows."""
    return ((True, 0),) + tuple((n <= plain_max_rows, n) for n in range(1, PLANNED_ROWS + 1))


def compact_weights(*weights: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Float32 weights in the narrowest format that holds every one of their values exactly, and the kernel's name for
    that format: bfloat16, float16, or float32 as they are. A bfloat16 checkpoint (what Qwen3, Qwen3.5, gpt-oss and
    Gemma publish) loaded into float32 has only bfloat16 values; widening them back in the kernel is exact, so its
    products are the same bits from half the bytes."""
    def holds(dtype: torch.dtype, weight: torch.Tensor) -> bool:
        return all(torch.equal(part.to(dtype).float(), part) for part in weight.reshape(-1).split(EXACT_CHECK_ELEMENTS))

    for dtype, name in COMPACT_FORMATS:
        if all(holds(dtype, weight) for weight in weights):
            return [weight.to(dtype) for weight in weights], name
    return list(weights), WEIGHT_F32


def amx_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 weight [n, k] of bfloat16 values in AMX's tiles (`amx_product`), or None where this CPU has no AMX or
    n or k is no multiple of AMX_ALIGN."""
    n, k = weight.shape
    if not AMX or n % _products.AMX_ALIGN or k % _products.AMX_ALIGN:
        return None
    weight = weight.contiguous()
    packed = torch.empty(n * k, dtype=torch.int16)
    _products.amx_pack(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def amx_product(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ w.T (+ bias) (+ residual [m, n]) in float32 on AMX tiles, w given by `amx_pack`."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = x.new_empty(x.shape[0], n)
    _products.amx_product(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), n, x.shape[1],
                          0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr(),
                          out.data_ptr(), n, torch.get_num_threads())
    return out


def weight_format(weight: torch.Tensor) -> int:
    """The kernel's name for a weight's format (float32, or a `compact_weights` copy in bfloat16 or float16)."""
    return next((name for dtype, name in COMPACT_FORMATS if weight.dtype == dtype), WEIGHT_F32)


class Linear:
    """y = x @ weight.T (+ bias): float32 on a CPU with AVX-512, up to `kernel_rows` rows by the small-row kernel;
    otherwise the product of n rows by `routes[n]`: MKL's (F.linear on the plain weight) or oneDNN's (on the weight
    packed once), on n rows or on n padded with zero rows to a count that runs faster. The kernel's weight (`weight`,
    in `format`) is the float32 one or, where it holds every value, its bfloat16 or float16 copy (`compact_weights`).

    Why: verification multiplies a handful of rows (1 + k draft tokens) by every weight matrix, and a decode step is
    bound by reading those weights. Which kernel streams a weight fastest for a few rows depends on the CPU, and so does
    the blocking oneDNN picks per row count: on an Intel Xeon MKL won up to three rows; on an AMD EPYC (Zen 4) oneDNN
    wins at every count and reads weights faster for four to six rows than for one or two (`python
    benchmarks/bench_verify_cost.py --products` times them and the kernel by row count), and the kernel streams it
    faster than either at every count to eight. `tune_products` measures the routes; until then they are
    `untuned_routes()`. A float32 weight is kept in both layouts: the packed copy, as large as the weight, runs prompt
    chunks, the plain one (in bfloat16 where it holds every value) a step's rows; without oneDNN it is F.linear. A
    weight of bfloat16 values on a CPU with AMX runs prompt chunks on AMX tiles instead (`amx`, in place of the packed
    copy: `amx_product`).
    """

    __slots__ = ("weight", "bias", "packed", "compute_dtype", "routes", "shape", "dtype", "kernel_rows", "format",
                 "amx")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 compute_dtype: torch.dtype | None = None):
        # compute_dtype: multiply in this dtype (inputs cast to it, outputs back to the input's dtype)
        self.compute_dtype = compute_dtype if compute_dtype not in (None, weight.dtype) else None
        if self.compute_dtype is not None:
            weight = weight.to(self.compute_dtype)
            bias = None if bias is None else bias.to(self.compute_dtype)
        self.bias, self.shape, self.dtype = bias, tuple(weight.shape), weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack and _onednn_available(weight) \
            else None
        # the plain weight stays for MKL's few-row products, except in bfloat16 (torch repacks it for every call)
        self.weight = weight if self.packed is None or weight.dtype == torch.float32 else None
        self.routes: tuple[Route, ...] = untuned_routes()
        # products of up to kernel_rows rows run by the kernel: a float32 weight on a CPU that has it
        self.kernel_rows = KERNEL_ROWS if weight.dtype == torch.float32 and weight.device.type == "cpu" else 0
        self.format, self.amx = WEIGHT_F32, None
        if self.kernel_rows:
            self.weight, self.bias = weight.contiguous(), None if bias is None else bias.contiguous()
            if self.packed is not None:  # the plain weight streams through the kernel alone (more rows: the packed)
                (self.weight,), self.format = compact_weights(self.weight)
            if self.format == _products.WEIGHT_BF16:  # more rows than the kernel's: AMX tiles, where there are
                self.amx = amx_pack(weight)
                self.packed = None if self.amx is not None else self.packed  # in place of oneDNN's float32 copy

    @property
    def family(self) -> str:
        """What a product's speed depends on besides the rows: the weight's shape and dtype, the kernels at hand."""
        return (f"{self.shape[0]}x{self.shape[1]} {str(self.dtype).removeprefix('torch.')} "
                f"mkl={self.multiplies_plain} bias={self.bias is not None}")

    @property
    def multiplies_plain(self) -> bool:
        """Whether MKL's product can take the plain weight: it is there, in float32 (not a kernel's compact copy)."""
        return self.weight is not None and self.format == WEIGHT_F32

    def _route(self, rows: int) -> Route:
        if self.packed is None:
            return True, rows
        if rows < len(self.routes):
            plain, padded = self.routes[rows]
            return plain and self.multiplies_plain, padded
        return False, rows

    def _product(self, x: torch.Tensor, plain: bool, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] (and residual [n, out]) -> [n, out] by the kernel named."""
        if plain:
            if residual is None:
                return F.linear(x, self.weight, self.bias)
            return torch.addmm(residual if self.bias is None else residual + self.bias, x, self.weight.t())
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), self.packed, self.bias, "add")

    def _kernel_product(self, x: torch.Tensor, rows: int, residual: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = flat.new_empty(rows, self.shape[0])
        if residual is not None:
            residual = residual.reshape(rows, self.shape[0]).contiguous()
        _products.small_product(flat.data_ptr(), flat.stride(0), self.weight.data_ptr(), self.shape[0],
                                self.shape[1], 0 if self.bias is None else self.bias.data_ptr(),
                                0 if residual is None else residual.data_ptr(), out.data_ptr(), self.shape[0], rows,
                                self.format, torch.get_num_threads())
        return out.view(*x.shape[:-1], self.shape[0])

    def _amx_product(self, x: torch.Tensor, rows: int, residual: torch.Tensor | None) -> torch.Tensor:
        out = amx_product(x.reshape(rows, x.shape[-1]), self.amx, self.shape[0], self.bias,
                          None if residual is None else residual.reshape(rows, self.shape[0]))
        return out.view(*x.shape[:-1], self.shape[0])

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 0 < rows <= self.kernel_rows and x.dtype == torch.float32:
            return self._kernel_product(x, rows, residual)
        if self.amx is not None and x.dtype == torch.float32:
            return self._amx_product(x, rows, residual) if rows else x.new_empty(*x.shape[:-1], self.shape[0])
        plain, padded = self._route(rows)
        flat = x.reshape(rows, x.shape[-1])
        flat_residual = None if residual is None else residual.reshape(rows, residual.shape[-1])
        if padded > rows:  # zero rows cost nothing to make and are cut away after
            flat = F.pad(flat, (0, 0, 0, padded - rows))
            flat_residual = None if residual is None else F.pad(flat_residual, (0, 0, 0, padded - rows))
        out = self._product(flat, plain, flat_residual)[:rows]
        return out.view(*x.shape[:-1], out.shape[-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            return self(x.to(self.compute_dtype)).to(x.dtype)
        return self._run(x)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the addition fused into the product (a residual connection: one pass less)."""
        if self.compute_dtype is not None or residual.shape[:-1] != x.shape[:-1]:
            return residual + self(x)
        return self._run(x, residual)


# ------------------------------------------------------------------------------------------------ tuning


def time_routes(linears: Sequence[Linear], repeats: int) -> dict[str, dict[Route, float]]:
    """Seconds of each family's products (summed over its members) by route, timed as a forward pass meets them:
    every Linear in order, so each weight comes from memory as in a decode step, not from a cache a repeat warmed."""
    routes = [(False, m) for m in range(1, PLANNED_ROWS + 1)] + [(True, m) for m in range(1, MKL_ROWS + 1)]
    clock = work_clock()  # on one thread its CPU time: a tuning beside other work still finds this machine's routes
    best: dict[str, dict[Route, float]] = defaultdict(dict)
    inputs: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # round 0 warms every kernel's shape up
            for plain, m in routes:
                sums: dict[str, float] = defaultdict(float)
                for lin in linears:
                    if plain and not lin.multiplies_plain:
                        continue
                    key = (lin.shape[1], m, lin.dtype)
                    if key not in inputs:
                        inputs[key] = torch.randn(m, lin.shape[1], dtype=lin.dtype)
                    start = clock()
                    lin._product(inputs[key], plain)
                    sums[lin.family] += clock() - start
                if round_:
                    for family, seconds in sums.items():
                        best[family][plain, m] = min(best[family].get((plain, m), float("inf")), seconds)
    return best


def plan_routes(times: dict[Route, float]) -> tuple[Route, ...]:
    """The fastest route for each row count n from one family's timings: MKL's at n, or oneDNN's at n or at a larger
    count (padding), where padding must win by PAD_MARGIN."""
    plan: list[Route] = [(True, 0)]
    for n in range(1, PLANNED_ROWS + 1):
        options = [(t * (PAD_MARGIN if m > n else 1.0), (plain, m)) for (plain, m), t in times.items()
                   if m == n or (not plain and m > n)]
        plan.append(min(options)[1] if options else (False, n))
    return tuple(plan)


def tune_products(linears: Iterable[Linear], *, repeats: int = 2, remeasure: bool = False) -> dict[str, list[Route]]:
    """Give every packed Linear the fastest route per row count on this machine (`plan_routes`), measured over these
    Linears in order (`time_routes`: about 2 s for SmolLM2) and kept per machine in the user cache, so later loads on
    the same machine read it back (remeasure=True measures again). Returns {family: routes}.

    The measurement is as good as the machine is quiet while it runs: `hybridspec calibrate` measures again."""
    from hybridspec.model.loading import first_run
    from hybridspec.model.machine import keep_measured, measured_here

    linears = [lin for lin in linears if lin.packed is not None and not lin.kernel_rows]  # the kernel needs no plan
    if not linears:
        return {}
    known = measured_here(PLANS_FILE)
    families = {lin.family for lin in linears}
    if remeasure or not families <= known.keys():
        with first_run(f"timing this CPU's matrix kernels for {len(families)} kinds of product"):
            measured = time_routes(linears, repeats)
        known = {**known, **{family: [list(r) for r in plan_routes(times)] for family, times in measured.items()}}
        keep_measured(PLANS_FILE, known)
    for lin in linears:
        lin.routes = tuple((bool(plain), int(m)) for plain, m in known[lin.family])
    return {family: known[family] for family in families}


class PackedLinear(torch.nn.Module):
    """Inference-only stand-in for an nn.Linear, computing with `Linear`; keeps `weight`, `bias`, `in_features` and
    `out_features` for code that reads them."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = Linear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(),
                             compute_dtype=compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 / AMX): oneDNN then runs a small-batch bfloat16
    product faster than float32 (half the weight bytes to read)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(module: torch.nn.Module, compute_dtype: torch.dtype | None = None, tune: bool = True
                 ) -> torch.nn.Module:
    """Swap every nn.Linear inside `module` for a `PackedLinear` (a drafter run next to the target at small batch),
    multiplying in compute_dtype if given, its products routed as this machine runs them fastest (`tune_products`)."""
    for name, child in module.named_children():
        if type(child) is torch.nn.Linear:
            setattr(module, name, PackedLinear(child, compute_dtype))
        else:
            pack_linears(child, compute_dtype, tune=False)
    if tune:
        tune_products([m.linear for m in module.modules() if isinstance(m, PackedLinear)])
    return module
