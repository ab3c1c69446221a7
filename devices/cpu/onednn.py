"""float32 matmuls of 2 rows or more on oneDNN's linear, over weights reordered once into
its blocked layout: the CPU's projections at verify widths, in batches and in prefill.

Why: torch's CPU matmul is MKL's sgemm, whose small-row path on the 2-core AMD EPYC
host of this project's CI costs about one row's time a row: a projection of 3 rows took
2.4-2.9x one row's time, so a speculative round's verify of 3 rows cost 1.4x a decode
step and drafting lost to plain decoding. oneDNN's linear on a prepacked weight grows far
slower with the rows (the embedded pair's 4096 x 256 head, us at 1 / 3 / 6 / 16 rows:
MKL 110 / 313 / 301 / 488, oneDNN 75 / 88 / 139 / 331; BENCHMARKS.md, stop 82), and it
still led by 7-20% at 256 to 2,048 rows, on the pair's shapes and llama-1b's. One row stays
on MKL, which is as fast or faster there for the small projections, so a plain decode
step at batch 1 is unchanged. ``torch.compile`` (the CPU's graph backend) packs weights its
own way: a traced call keeps ``F.linear``.

HAZARDS: a weight's packed copy is taken at its first matmul here and kept beside it
(its memory again, within the budget):
- it is repacked when the weight changes in place (its version counter moves) or its
  storage is swapped (``param.data = ...``), but not after ``param.data.copy_(...)``
  (``.data`` counts its own versions): weights must be written before their first
  matmul, as the loaders do;
- a weight is known by its identity: pass stable parameters, not a view made per call
  (each would be packed anew and held until the budget is spent), and give each model
  its own table (a table holds the weights it packed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# The fewest rows sent to oneDNN: one row is MKL's (faster for projections under 1,280
# outputs, and llama-1b's gate/up and down).
MIN_ROWS = 2


def onednn_available() -> bool:
    """Does this torch build have oneDNN's prepacked linear (x86 builds do)?"""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 -> its copy in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    # The hint is the row count oneDNN tunes the layout for; 4 sits mid-range.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 4)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(T, K) @ packed (N, K).T + bias (N,), contiguous -> (T, N), on oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedWeights:
    """``linear(x, weight, bias)`` (``F.linear``'s contract) on oneDNN for float32 inputs
    of MIN_ROWS rows or more, each weight reordered at its first such call while the
    packed copies fit the budget; every other call is ``F.linear``.

    ``read_budget``: called once, at the first packing (the model's weights and the KV
    pool are in memory by then), for how many bytes the copies may take."""

    def __init__(self, read_budget: Callable[[], int]):
        self._read_budget = read_budget
        self.budget_bytes: int | None = None  # read_budget's answer, at the first packing
        self.packed_bytes = 0
        self.usable = onednn_available()
        # id(weight) -> (weight, data_ptr, version, bytes, packed): the weight is held so
        # that its id is not reused while the entry stands (model weights live as long
        # as the model, which holds this table through its ops).
        self._packed: dict[int, tuple[torch.Tensor, int, int, int, torch.Tensor]] = {}
        self.packs = 0  # weights reordered so far, repacks included

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = self._packed_copy(x, weight, bias)
        if packed is None:
            return F.linear(x, weight, bias)
        return packed_linear(x, packed, bias)

    def _packed_copy(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``weight``'s packed copy where this call may run on oneDNN, else None."""
        if (
            not self.usable
            or x.dim() != 2
            or x.shape[0] < MIN_ROWS
            or x.dtype != torch.float32
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            # oneDNN reads the bias as a dense (N,) row: another stride or shape would be
            # read wrong or refused, where F.linear broadcasts it.
            or (bias is not None and not (bias.dim() == 1 and bias.is_contiguous()))
            or (bias is not None and bias.dtype != torch.float32)
            or torch.compiler.is_compiling()
            # oneDNN's op has no backward: a call that records one keeps F.linear.
            or (torch.is_grad_enabled() and any(_needs_grad(t) for t in (x, weight, bias)))
        ):
            return None
        version = 0 if weight.is_inference() else weight._version
        entry = self._packed.get(id(weight))
        if entry is not None:
            _, data_ptr, packed_version, size, packed = entry
            if data_ptr == weight.data_ptr() and packed_version == version:
                return packed
            self.packed_bytes -= size
            del self._packed[id(weight)]
        if self.budget_bytes is None:
            self.budget_bytes = self._read_budget()
        size = weight.numel() * weight.element_size()  # the packed copy's, near enough
        if self.packed_bytes + size > self.budget_bytes:
            return None
        try:
            packed = pack_weight(weight)
        except RuntimeError:  # a CPU or build whose oneDNN cannot: MKL from now on
            self.usable = False
            return None
        self._packed[id(weight)] = (weight, weight.data_ptr(), version, size, packed)
        self.packed_bytes += size
        self.packs += 1
        return packed


def _needs_grad(t: torch.Tensor | None) -> bool:
    return t is not None and t.requires_grad
