"""A stand-in GPU for the CPU tests: the real launch layer (plans, params structs, tensor maps, repeat calls,
the compiled training node, the decode plans) over CPU stand-ins for the kernels and the driver.

:func:`install` makes ``attention()`` on float16/bfloat16 CPU tensors take the kernel path of a GPU of the
given architecture. Every "kernel" computes its part of the attention in float64 from the tensors at the
addresses in the params struct it is launched with, and writes its outputs there; the forward kernels of
the TMA configurations read q, k and v through their tensor maps (the stand-in encode writes the address,
the dimensions and the byte strides into the map). So a result is right only if every pointer, stride,
map and workspace offset the launch layer filled in is right: a wrong one reads the wrong memory. The decode
family's stand-ins (append, decode with its split partials, combine) make ``attention_with_kvcache`` on
such tensors run :class:`flash_attention.ops.decode.DecodePlan` the same way.
Launches are counted by kernel kind in ``StandInGpu.launches``.
"""

from __future__ import annotations

import ctypes
import struct

import pytest
import torch

from flash_attention import ops
from flash_attention.fallback.reference import attention_reference
from flash_attention.jit import driver, host
from flash_attention.jit.params import BwdParams, BwdTmaParams, DecodeParams, FwdParams, FwdTmaParams
from flash_attention.jit.sources import SEGMENTS
from flash_attention.ops import backward, decode, dispatch, forward, plans, repeat, tma

__all__ = ["StandInGpu", "install", "repeat_mode_gpu", "tensor_at"]

_FACTS = {
    "sm_90": {"arch": "sm_90", "gpu": "NVIDIA H100 80GB HBM3", "smem_limit": 227 * 1024},
    "sm_80": {"arch": "sm_80", "gpu": "NVIDIA A100-SXM4-80GB", "smem_limit": 163 * 1024},
}
_PRIMARY = 0xC0FFEE  # the stand-in primary context


def tensor_at(address: int, shape, strides, dtype) -> torch.Tensor:
    """A CPU tensor viewing memory at ``address`` (what a kernel sees through a pointer)."""
    if address in (0, None):
        raise AssertionError("a kernel was handed a null pointer")
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    size = torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * (span * size)).from_address(address)
    return torch.frombuffer(buf, dtype=dtype).as_strided(shape, strides)


def _encode(field, layout, address, *, one_byte: bool = False) -> int:
    """The stand-in of tma.encode_into (its signature; the element size is the stand-in reader's dtype): the
    map holds the address, the 4 dims and the 3 byte strides. As the driver, it refuses a global address
    that is not 16-byte aligned (CUDA_ERROR_INVALID_VALUE)."""
    if address % 16:
        return 1
    values = [address, *layout.dims, *layout.strides]
    ctypes.memmove(field, struct.pack(f"<{len(values)}Q", *values), 8 * len(values))
    return 0


def _through_map(field, dtype) -> torch.Tensor:
    """The (batch, seqlen, heads, head_dim) tensor a stand-in map describes."""
    address, d, s, h, b, row, head, batch = struct.unpack("<8Q", bytes(field)[:64])
    size = torch.empty((), dtype=dtype).element_size()
    return tensor_at(address, (b, s, h, d), (batch // size, row // size, head // size, 1), dtype)


class _Handle:
    def __init__(self, value: int):
        self.value = value


#: The score-function builds the stand-in kernels compute (None: the identity), and those of a packed batch's
#: segments builds (ALiBi measured from each row's run end, or from the segments' table of diagonals, with
#: one slope table or a slope per query row).
_SCORE_BUILDS = (None, "softcap", "alibi", "softcap_alibi")
_SEGMENT_SCORE_BUILDS = (
    *(None, "alibi_runs", "alibi_table"),
    *("alibi_rows", "alibi_runs_rows", "alibi_table_rows"),
)


class _Kernel:
    """A stand-in ``driver.Kernel``: ``launch`` runs ``gpu.run(kind, causal, params)`` on the CPU.
    ``params_type`` is the ctypes struct it takes (what the host library's launches are read back as);
    ``window`` (the sliding-window build: its bounds are the params') and ``score`` (the score function's
    build: "softcap", "alibi" or both, the cap and the slopes the params') are the build's, as the launch
    layer asked for it."""

    def __init__(
        self, gpu: StandInGpu, kind: str, causal: bool = False, params_type=BwdParams, window=False,
        score=None,
    ):  # fmt: skip
        builds = _SEGMENT_SCORE_BUILDS if window == SEGMENTS else _SCORE_BUILDS
        if window not in (False, True, SEGMENTS) or score not in builds:
            raise AssertionError(f"the stand-in kernels have no {score or window} build")
        self.gpu, self.kind, self.causal, self.params_type = gpu, kind, causal, params_type
        self.window, self.score = window, score
        self.name = f"stand_in_{kind}{'_causal' if causal else ''}"
        self.handle = _Handle(gpu.register(self))

    def ensure_dynamic_smem(self, nbytes: int, index: int) -> None:
        pass

    def launch(self, grid, block, smem, stream, params, programmatic=False) -> None:
        self.gpu.programmatic.append((self.kind, programmatic))
        self.gpu.run(self, params)


class _BackwardKernels(dict):
    """``get_bwd_kernels``' dict: by kind for the mask-free kernels, by symbol for the others. ``tma``: the
    config loads Q and dO by TMA, so its dK/dV kernels take BwdTmaParams and read q and dO through the maps
    (the other kernels the BwdParams prefix of the same bytes)."""

    def __init__(self, gpu: StandInGpu, window=False, score=None, tma=False):
        super().__init__()
        self.gpu, self.window, self.score, self.tma = gpu, window, score, tma

    def __missing__(self, symbol: str) -> _Kernel:
        kind = symbol if symbol in ("pre", "convert") else symbol.split("__")[1]
        params_type = BwdTmaParams if self.tma and kind.startswith("dkdv") else BwdParams
        kernel = self[symbol] = _Kernel(
            self.gpu, kind, "__causal" in symbol, params_type, window=self.window, score=self.score
        )
        return kernel


class _DecodeKernels(dict):
    """``get_decode_kernels``' dict, by symbol, with the config (the partials' row width is its head_dim)."""

    def __init__(self, gpu: StandInGpu, cfg):
        super().__init__()
        self.gpu, self.cfg = gpu, cfg

    def __missing__(self, symbol: str) -> _Kernel:
        kind = symbol.split("__")[1]
        kernel = self[symbol] = _Kernel(self.gpu, "decode_" + kind, "__causal" in symbol, DecodeParams)
        kernel.paged = "__paged" in symbol
        kernel.cfg = self.cfg
        kernel.blocks_per_sm = lambda threads, smem, index: 2
        return kernel


class StandInGpu:
    def __init__(self, dtype: torch.dtype, arch: str):
        self.dtype, self.arch = dtype, arch
        self.launches: list[str] = []
        self.programmatic: list[tuple] = []  # (kernel kind, queued programmatically) of each Python launch
        # (config name, arch, window build, score, ranged, dropout) of each backward build loaded, and of
        # each one a training call asked to compile ahead (ops.backward.prefetch)
        self.backward_builds: list[tuple] = []
        self.prefetched: list[tuple] = []
        self.counters: list[int] = []  # each TMA forward launch's tile-counter address (0: none)
        self.key_tile_walks = 0  # packed backward launches that walked a key-tile table (p.k_tiles)
        self.errors: list[BaseException] = []
        self._kernels: dict[int, _Kernel] = {}
        self.encodes = 0  # tensor maps the host library had encoded
        self.output_maps = 0  # forward launches that wrote O through its tensor map (configs with tma_store)
        self.backward_maps = 0  # dK/dV launches that read q and dO through their tensor maps (tma_loads)
        self._callbacks = ()

    def register(self, kernel: _Kernel) -> int:
        handle = 0x1000 + len(self._kernels)
        self._kernels[handle] = kernel
        return handle

    # The host library's driver entry points (its node launches through them).
    def install_driver(self, host_ops) -> None:
        def launch(kernel, gx, gy, gz, bx, by, bz, smem, stream, args, extra, programmatic=False):
            try:
                stand_in = self._kernels[kernel]
                self.programmatic.append((stand_in.kind, programmatic))
                size = ctypes.sizeof(stand_in.params_type)
                p = stand_in.params_type.from_buffer_copy((ctypes.c_char * size).from_address(args[0]))
                self.run(stand_in, p)
            except BaseException as exc:  # (raised inside a C callback: reported through the status)
                self.errors.append(exc)
                return 999
            return 0

        def get(out):
            out[0] = _PRIMARY
            return 0

        def error(status, text):
            text[0] = b"stand-in failure"
            return 0

        def encode(map_address, data_type, rank, address, dims, strides, box, element_strides, *flags):
            # What the host library's repeat call asks of cuTensorMapEncodeTiled: ours, as tma.py encodes.
            try:
                assert (data_type, *flags) == driver.TENSOR_MAP_ENCODE_FLAGS and rank == 4, (data_type, flags)
                assert [element_strides[i] for i in range(4)] == [1, 1, 1, 1]
                assert box[0] == tma.BOX_COLUMNS and box[2] == box[3] == 1
                layout = tma.MapLayout([dims[i] for i in range(4)], [strides[i] for i in range(3)], None)
                status = _encode(
                    ctypes.cast(map_address, ctypes.POINTER(ctypes.c_ubyte * 128)).contents, layout, address
                )
                assert status == 0, f"a tensor map asked for a misaligned address {address:#x}"
                self.encodes += 1
            except BaseException as exc:
                self.errors.append(exc)
                return 999
            return 0

        def launch_ex(config, kernel, args, extra):  # cuLaunchKernelEx: only ever with the one attribute
            c = config.contents
            attrs = [(c.attrs[i].id, c.attrs[i].value) for i in range(c.num_attrs)]
            if attrs != [(driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)]:
                self.errors.append(AssertionError(f"unexpected launch attributes {attrs}"))
                return 999
            return launch(kernel, *c.grid, *c.block, c.smem, c.stream, args, extra, programmatic=True)

        self._callbacks = host.set_stand_in_driver(
            host_ops, launch, get, lambda ctx: 0, error, encode, launch_ex
        )

    # ---------------------------------------------------------------------------------------------------
    # The kernels

    def run(self, kernel: _Kernel, params) -> None:
        self.launches.append(kernel.kind)
        if kernel.kind == "forward":
            self._forward(kernel, params)
        elif kernel.kind.startswith("decode_"):
            getattr(self, "_" + kernel.kind)(kernel, params)
        else:
            self._backward(kernel, params)

    def _bshd(self, p, ptr, prefix, seqlen, heads):
        strides = tuple(getattr(p, f"{prefix}_{n}_stride") for n in ("batch", "row", "head")) + (1,)
        # (v, the output and their gradients: v's head_dim, FwdParams' or BwdParams' head_dim_v, where set)
        dim = getattr(p, "head_dim_v", 0) or p.head_dim if prefix in ("v", "o", "do", "dv") else p.head_dim
        return tensor_at(ptr, (p.batch, seqlen, heads, dim), strides, self.dtype)

    def _key_range(self, p):
        return None if not p.key_range else tensor_at(p.key_range, (p.batch, 2), (2, 1), torch.int32).clone()

    @staticmethod
    def _variant(kernel, p) -> dict:
        """The reference's arguments for the kernel's build: causal, and the window's bounds and the cap as
        the params carry them (a window build's causal is its right bound 0, fa/visible_keys.cuh)."""
        variant = {"causal": kernel.causal}
        if kernel.window:
            variant["window"] = (p.window_left, p.window_right)
        if kernel.score in ("softcap", "softcap_alibi"):
            assert p.score_values[0] > 0, "a soft-capping build launched without its cap"
            variant["softcap"] = p.score_values[0]
        else:
            assert p.score_values[0] == 0, "a cap in the params of a build without soft-capping"
        if kernel.score in ("alibi", "softcap_alibi"):
            # (heads_q,) or, with a stride between batch rows, (batch, heads_q) float32 slopes.
            stride = p.alibi_batch_stride
            shape, strides = ((p.batch, p.heads_q), (stride, 1)) if stride else ((p.heads_q,), (1,))
            variant["alibi_slopes"] = tensor_at(p.alibi_slopes, shape, strides, torch.float32).clone()
        if getattr(p, "sinks", 0):  # (the forward's params: the sinks join the epilogue's LSE)
            variant["sinks"] = tensor_at(p.sinks, (p.heads_q,), (1,), torch.float32).clone()
        return variant

    def _forward(self, kernel, params) -> None:
        p = getattr(params, "p", params)
        if p.dropout_threshold:
            raise AssertionError("the stand-in kernels have no dropout")
        if hasattr(params, "tile_counter"):
            self.counters.append(params.tile_counter)
        if hasattr(params, "q_map"):  # a TMA kernel reads q, k and v through their maps
            q, k, v = (_through_map(m, self.dtype) for m in (params.q_map, params.k_map, params.v_map))
            for t, ptr in ((q, p.q), (k, p.k), (v, p.v)):
                assert t.data_ptr() == ptr, "a tensor map and the params disagree on an address"
        else:
            q = self._bshd(p, p.q, "q", p.seqlen_q, p.heads_q)
            k = self._bshd(p, p.k, "k", p.seqlen_k, p.heads_kv)
            v = self._bshd(p, p.v, "v", p.seqlen_k, p.heads_kv)
        assert q.shape[3] == p.head_dim and k.shape[1] == p.seqlen_k, "the params disagree on a size"
        assert v.shape[3] == p.head_dim_v, "the params' head_dim_v is not v's (the kernels bound O by it)"
        if kernel.window == SEGMENTS:
            out, lse = self._segments_forward(kernel, q, k, v, p)
        else:
            out, lse = attention_reference(
                q, k, v, softmax_scale=p.scale, key_range=self._key_range(p), **self._variant(kernel, p)
            )
        o = self._bshd(p, p.o, "o", p.seqlen_q, p.heads_q)
        if any(bytes(getattr(params, "o_map", b""))):  # a config with tma_store writes O through its map
            o = _through_map(params.o_map, self.dtype)
            assert o.data_ptr() == p.o, "the output's tensor map and the params disagree on its address"
            self.output_maps += 1
        o.copy_(out)
        if p.lse:
            strides = (p.lse_batch_stride, p.lse_head_stride, 1)
            tensor_at(p.lse, (p.batch, p.heads_q, p.seqlen_q), strides, torch.float32).copy_(lse)

    @staticmethod
    def _segments_scores(kernel, p, qd, kd):
        """A segments build's scaled, masked scores (heads_q, seqlen_q, seqlen_k) in float64 from (heads,
        rows, d) operands: each query row i sees the keys of its run [row_keys[i, 0], row_keys[i, 1])
        (flash_attention.api.varlen); with ALiBi, -slope |diagonal(i) - j| added, the diagonal the run's end -
        1 ("alibi_runs") or the segments' table entry p.alibi_diagonal[i] ("alibi_table"); the "_rows" builds
        with row i's slope for head h at p.alibi_slopes[i * p.alibi_batch_stride + h], "alibi_rows" measured
        from the packed row's own index (packed self-attention)."""
        assert p.batch == 1 and p.row_keys and p.key_rows, "a segments launch without its runs"
        runs = tensor_at(p.row_keys, (p.seqlen_q, 2), (2, 1), torch.int32).long()
        assert tensor_at(p.key_rows, (p.seqlen_k, 2), (2, 1), torch.int32).shape[0] == p.seqlen_k
        cols = torch.arange(p.seqlen_k)
        seen = (cols >= runs[:, :1]) & (cols < runs[:, 1:])  # (seqlen_q, seqlen_k)
        scores = qd @ kd.transpose(1, 2) * p.scale
        if kernel.score is not None and kernel.score.endswith("_rows"):
            assert p.alibi_batch_stride == p.heads_q, "per-row slopes are a (seqlen_q, heads_q) table"
            rows = tensor_at(p.alibi_slopes, (p.seqlen_q, p.heads_q), (p.heads_q, 1), torch.float32)
            slopes = rows.double().T[:, :, None]  # (heads, rows, 1)
        elif kernel.score is not None:
            assert p.alibi_batch_stride == 0, "a packed batch's slopes are one (heads,) table"
            slopes = tensor_at(p.alibi_slopes, (p.heads_q,), (1,), torch.float32).double()[:, None, None]
        if kernel.score is not None:
            if kernel.score.startswith("alibi_table"):
                diagonal = tensor_at(p.alibi_diagonal, (p.seqlen_q,), (1,), torch.int32).long()
            elif kernel.score == "alibi_rows":
                assert p.seqlen_q == p.seqlen_k, "the packed row's own index: packed self-attention"
                diagonal = torch.arange(p.seqlen_q)
            else:
                assert not p.alibi_diagonal, "a table of diagonals bound to a build that does not read it"
                diagonal = runs[:, 1] - 1
            distance = (diagonal[:, None] - cols[None, :]).abs().double()
            scores = scores - slopes * distance
        return scores.masked_fill(~seen, float("-inf"))

    def _segments_forward(self, kernel, q, k, v, p):
        """The segments build on a batch of one (_segments_scores), in float64. A query-tile table (the
        warp-specialized forward's, p.q_tiles) must cover every row exactly once."""
        if p.q_tiles:
            tiles = tensor_at(p.q_tiles, (p.num_m_blocks, 2), (2, 1), torch.int32).long()
            covered = torch.zeros(p.seqlen_q, dtype=torch.long)
            for start, end in tiles.tolist():
                covered[start:end] += 1
            assert (covered == 1).all(), "the query-tile table does not cover every row once"
        group = q.shape[2] // k.shape[2]
        qd = q[0].double().transpose(0, 1)  # (heads, seqlen_q, d)
        kd = k[0].double().transpose(0, 1).repeat_interleave(group, 0)
        vd = v[0].double().transpose(0, 1).repeat_interleave(group, 0)
        scores = self._segments_scores(kernel, p, qd, kd)
        lse = torch.logsumexp(scores, -1)
        probs = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
        out = (probs @ vd).transpose(0, 1).unsqueeze(0)
        if p.sinks:  # (each head's sink joins every row's softmax: O and the LSE rescaled, fa.sinks)
            sink = tensor_at(p.sinks, (p.heads_q,), (1,), torch.float32).double()[:, None]
            joined = torch.logaddexp(lse, sink)
            out = out * torch.exp(lse - joined).T[None, :, :, None]
            lse = joined
        return out, lse.unsqueeze(0).float()

    def _rows(self, ptr, p):
        shape, strides = (p.batch, p.heads_q, p.seqlen_q_pad), (p.heads_q * p.seqlen_q_pad, p.seqlen_q_pad, 1)
        return tensor_at(ptr, shape, strides, torch.float32)

    def _accum(self, p):
        shape = (p.batch, p.heads_q, p.seqlen_q_pad, p.head_dim)
        strides = (p.heads_q * p.seqlen_q_pad * p.head_dim, p.seqlen_q_pad * p.head_dim, p.head_dim, 1)
        return tensor_at(p.dq_accum, shape, strides, torch.float32)

    def _workspace_rows(self, p) -> torch.Tensor:
        """Each packed row's workspace row: by the units table (p.q_units, ops.query_tiles.query_units) where
        the plan has one, which must place every row exactly once and only in rows it owns; else the row
        itself."""
        if not p.q_units:
            return torch.arange(p.seqlen_q)
        units = tensor_at(p.q_units, (p.seqlen_q_pad // 64, 2), (2, 1), torch.int32).long()
        rows = torch.full((p.seqlen_q,), -1, dtype=torch.long)
        for u, (start, count) in enumerate(units.tolist()):
            assert 0 <= count <= 64 and (count == 0 or 0 <= start <= start + count <= p.seqlen_q)
            assert (rows[start : start + count] == -1).all(), "a row in two workspace units"
            rows[start : start + count] = 64 * u + torch.arange(count)
        assert (rows >= 0).all(), "a row in no workspace unit"
        return rows

    def _segments_backward(self, kernel, p, x) -> None:
        """The segments build's backward on a batch of one, in float64 from the runs, through the workspace
        as the kernels lay it out: the preprocessing kernel writes delta at each row's workspace row
        (_workspace_rows), the dK/dV kernel walks each key tile's rows [q0, q1) reading delta at w0 + (row
        - q0) and adding dQ there (the key-tile table, p.k_tiles), the cast kernel reads dQ back by unit.
        A table of another batch (other sequence boundaries) then gives wrong gradients, as on a GPU."""
        assert p.batch == 1 and p.row_keys and p.key_rows, "a segments launch without its runs"
        assert bool(p.k_tiles) == bool(p.q_units), "a key-tile table without its workspace units, or back"
        ws = self._workspace_rows(p)
        delta_rows = self._rows(p.delta, p)[0]  # (heads_q, seqlen_q_pad)
        kind = kernel.kind
        if kind == "pre":
            delta = (x["dout"].double() * x["o"].double()).sum(-1)[0].transpose(0, 1)  # (heads, seqlen_q)
            delta_rows[:, ws] = delta.float()
            if p.dq_accum:
                self._accum(p).zero_()
            return
        if kind == "convert":
            x["dq"][0].copy_(self._accum(p)[0][:, ws, :].transpose(0, 1))
            return
        group = p.heads_q // p.heads_kv
        qd, dod = (x[n][0].double().transpose(0, 1) for n in ("q", "dout"))  # (heads_q, rows, d)
        kd, vd = (x[n][0].double().transpose(0, 1).repeat_interleave(group, 0) for n in "kv")
        scores = self._segments_scores(kernel, p, qd, kd)
        lse = torch.logsumexp(scores, -1, keepdim=True).nan_to_num(neginf=0.0)
        probs = torch.exp(scores - lse)  # (heads_q, seqlen_q, seqlen_k)
        dprobs = dod @ vd.transpose(1, 2)
        if p.k_tiles:  # each tile's keys against its rows [q0, q1), delta and dQ at w0 + (row - q0)
            tiles = tensor_at(p.k_tiles, (p.num_n_blocks, 8), (8, 1), torch.int32).long()
            pieces = [(k0, k1, q0, w0, q1) for k0, k1, q0, w0, q1, *_ in tiles.tolist() if k1 > k0]
            self.key_tile_walks += 1
        else:
            pieces = [(0, p.seqlen_k, 0, 0, p.seqlen_q)]
        dk = torch.full_like(kd, float("nan"))
        dv = torch.full_like(vd, float("nan"))
        accum = self._accum(p)[0] if p.dq_accum else None
        dq = torch.zeros_like(qd)
        for k0, k1, q0, w0, q1 in pieces:
            assert dk[:, k0:k1].isnan().all(), "a key in two tiles"
            wsr = torch.arange(q0, q1) - q0 + w0
            ds = probs[:, q0:q1, k0:k1] * (dprobs[:, q0:q1, k0:k1] - delta_rows[:, wsr, None].double())
            dk[:, k0:k1] = ds.transpose(1, 2) @ qd[:, q0:q1] * p.scale
            dv[:, k0:k1] = probs[:, q0:q1, k0:k1].transpose(1, 2) @ dod[:, q0:q1]
            part = ds @ kd[:, k0:k1] * p.scale
            if accum is not None and p.k_tiles:
                accum[:, wsr] += part.float()
            dq[:, q0:q1] += part
        shape = (p.heads_kv, group, p.seqlen_k, -1)
        dk, dv = (t.reshape(shape).sum(1) for t in (dk, dv))  # (GQA: a K/V head's query heads summed)
        if kind in ("dkdv", "dkdv_det"):
            x["dk"][0].copy_(dk.transpose(0, 1))
            x["dv"][0].copy_(dv.transpose(0, 1))
            if accum is not None and not p.k_tiles:
                accum[:, : p.seqlen_q] = dq.float()
        elif kind == "dq":
            x["dq"][0].copy_(dq.transpose(0, 1))
        else:
            raise AssertionError(f"unknown stand-in kernel {kind}")

    def _backward(self, kernel, params) -> None:
        kind = kernel.kind
        p = getattr(params, "p", params)  # (the BwdParams of a BwdTmaParams)
        x = {
            name: self._bshd(p, getattr(p, name), prefix, *dims)
            for name, prefix, dims in (
                ("q", "q", (p.seqlen_q, p.heads_q)), ("k", "k", (p.seqlen_k, p.heads_kv)),
                ("v", "v", (p.seqlen_k, p.heads_kv)), ("o", "o", (p.seqlen_q, p.heads_q)),
                ("dout", "do", (p.seqlen_q, p.heads_q)), ("dq", "dq", (p.seqlen_q, p.heads_q)),
                ("dk", "dk", (p.seqlen_k, p.heads_kv)), ("dv", "dv", (p.seqlen_k, p.heads_kv)),
            )
        }  # fmt: skip
        if kernel.params_type is BwdTmaParams:  # q and dO through their maps, which must describe them
            for name, map_field in (("q", params.q_map), ("dout", params.do_map)):
                t = _through_map(map_field, self.dtype)
                assert t.data_ptr() == x[name].data_ptr(), f"{name}'s tensor map and the params disagree"
                moved = zip(t.shape, t.stride(), x[name].stride(), strict=True)  # (extent-1 strides are free)
                same = all(a == b for n, a, b in moved if n > 1)
                assert t.shape == x[name].shape and same, f"{name}'s map's layout"
                x[name] = t
            self.backward_maps += 1
        if kernel.window == SEGMENTS:
            self._segments_backward(kernel, p, x)
            return
        if kind == "pre":
            delta = (x["dout"].double() * x["o"].double()).sum(-1).transpose(1, 2)
            self._rows(p.delta, p)[:, :, : p.seqlen_q] = delta.float()
            if p.dq_accum:
                self._accum(p).zero_()
            return
        if kind == "convert":
            x["dq"].copy_(self._accum(p)[:, :, : p.seqlen_q, :].transpose(1, 2))
            return
        q, k, v = (x[n].double().requires_grad_() for n in "qkv")
        with torch.enable_grad():  # (the engine runs a backward node with grad mode off)
            out, _ = attention_reference(
                q, k, v, softmax_scale=p.scale, key_range=self._key_range(p), **self._variant(kernel, p)
            )
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), x["dout"].double())
        # The later kernels read what the preprocessing kernel wrote, as the real ones do.
        delta = (x["dout"].double() * x["o"].double()).sum(-1).transpose(1, 2)
        torch.testing.assert_close(
            self._rows(p.delta, p)[:, :, : p.seqlen_q].double(), delta, rtol=1e-5, atol=1e-5
        )
        if kind in ("dkdv", "dkdv_det"):
            x["dk"].copy_(dk)
            x["dv"].copy_(dv)
            if p.dq_accum:
                self._accum(p)[:, :, : p.seqlen_q, :] = dq.transpose(1, 2).float()
        elif kind == "dq":
            x["dq"].copy_(dq)
        else:
            raise AssertionError(f"unknown stand-in kernel {kind}")

    # The decode family: rows of a cache read through the params, as fa/kv_cache.cuh reads them.
    def _cache(self, p, ptr, prefix, kernel):
        """The whole cache through the params: (batch, capacity, ...) rows, or (num_pages, page_size, ...)."""
        strides = tuple(getattr(p, f"{prefix}_{x}_stride") for x in ("batch", "row", "head")) + (1,)
        outer, rows = (p.num_pages, p.page_size) if kernel.paged else (p.batch, p.capacity)
        return tensor_at(ptr, (outer, rows, p.heads_kv, p.head_dim), strides, self.dtype)

    def _slots(self, p, kernel, table, b, positions):
        """The cache index of row b's ``positions`` (through the page table for a paged cache; from the row's
        cache_starts entry in a contiguous one that has them, fa/kv_cache.cuh's cache_start)."""
        if not kernel.paged:
            if p.cache_starts:
                start = tensor_at(p.cache_starts, (p.batch,), (1,), torch.int32)[b].item()
                assert start >= 0 and start + positions.numel() <= p.capacity, "a start past the cache"
                return b, positions + start
            return b, positions
        return table[b][positions // p.page_size].long(), positions % p.page_size

    def _tables(self, p):
        if p.cache_seqlens:
            lengths = tensor_at(p.cache_seqlens, (p.batch,), (1,), torch.int32).tolist()
        else:  # one length for every row, by value (fa/kv_cache.cuh's cache_length)
            lengths = [p.cache_seqlen] * p.batch
        table = None
        if p.block_table:
            table = tensor_at(
                p.block_table, (p.batch, p.block_table_stride), (p.block_table_stride, 1), torch.int32
            )
        return lengths, table

    def _decode_append(self, kernel, p) -> None:
        lengths, table = self._tables(p)
        for name, ptr, prefix in (("kn", p.k_new, "k"), ("vn", p.v_new, "v")):
            strides = tuple(getattr(p, f"{name}_{x}_stride") for x in ("batch", "row", "head")) + (1,)
            new = tensor_at(ptr, (p.batch, p.seqlen_new, p.heads_kv, p.head_dim), strides, self.dtype)
            cache = self._cache(p, p.k if prefix == "k" else p.v, prefix, kernel)
            for b in range(p.batch):
                positions = torch.arange(lengths[b], lengths[b] + p.seqlen_new)
                cache[self._slots(p, kernel, table, b, positions)] = new[b]

    def _decode_decode(self, kernel, p) -> None:
        lengths, table = self._tables(p)
        splits, per_split, width = p.num_splits, p.keys_per_split, kernel.cfg.head_dim
        shape_q = (p.batch, p.seqlen_q, p.heads_q, p.head_dim)
        q = tensor_at(p.q, shape_q, (p.q_batch_stride, p.q_row_stride, p.q_head_stride, 1), self.dtype)
        if splits > 1:
            rows = splits * p.batch * p.heads_q * p.seqlen_q
            o_part = tensor_at(p.o_partial, (rows, width), (width, 1), torch.float32)
            o_part = o_part.view(splits, p.batch, p.heads_q, p.seqlen_q, width)
            lse_part = tensor_at(p.lse_partial, (rows,), (1,), torch.float32)
            lse_part = lse_part.view(splits, p.batch, p.heads_q, p.seqlen_q)
        for b in range(p.batch):
            n = lengths[b] + p.seqlen_new
            slots = self._slots(p, kernel, table, b, torch.arange(n))
            k = self._cache(p, p.k, "k", kernel)[slots].double().repeat_interleave(p.group, dim=1)
            v = self._cache(p, p.v, "v", kernel)[slots].double().repeat_interleave(p.group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[b].double(), k) * p.scale
            if p.softcap:  # (the kernels' run-time cap: cap * tanh(s * (1 / cap)), both from the params)
                scores = p.softcap * torch.tanh(scores * p.softcap_inv)
            keys = torch.arange(n)
            visible = torch.ones(p.seqlen_q, n, dtype=torch.bool)
            if kernel.causal:
                visible = keys[None, :] <= torch.arange(p.seqlen_q)[:, None] + n - p.seqlen_q
            for s in range(splits):
                # (the last split runs to the row's end, fa/decode_block.cuh: a row longer than the splits
                # were sized for is still covered whole)
                end = (s + 1) * per_split if s < splits - 1 else n
                part = visible & (keys[None, :] >= s * per_split) & (keys[None, :] < end)
                masked = scores.masked_fill(~part, float("-inf"))
                lse = torch.logsumexp(masked, dim=-1)  # (heads_q, seqlen_q)
                weights = torch.exp(masked - lse[..., None]).nan_to_num(0.0)
                o = torch.einsum("hqk,khd->qhd", weights, v)  # (seqlen_q, heads_q, head_dim)
                if splits > 1:
                    o_part[s, b, :, :, : p.head_dim] = o.transpose(0, 1).float()
                    lse_part[s, b] = lse.float()
                else:
                    self._decode_write(p, b, o, lse)

    def _decode_write(self, p, b, o, lse) -> None:
        shape_o = (p.batch, p.seqlen_q, p.heads_q, p.head_dim)
        out = tensor_at(p.o, shape_o, (p.o_batch_stride, p.o_row_stride, p.o_head_stride, 1), self.dtype)
        out[b] = o.to(self.dtype)
        if p.lse:
            strides = (p.lse_batch_stride, p.lse_head_stride, 1)
            tensor_at(p.lse, (p.batch, p.heads_q, p.seqlen_q), strides, torch.float32)[b] = lse.float()

    def _decode_combine(self, kernel, p) -> None:
        splits, width = p.num_splits, kernel.cfg.head_dim
        rows = splits * p.batch * p.heads_q * p.seqlen_q
        o_part = tensor_at(p.o_partial, (rows, width), (width, 1), torch.float32)
        o_part = o_part.view(splits, p.batch, p.heads_q, p.seqlen_q, width)[..., : p.head_dim].double()
        lse_part = tensor_at(p.lse_partial, (rows,), (1,), torch.float32).view(splits, p.batch, p.heads_q, -1)
        lse = torch.logsumexp(lse_part.double(), dim=0)  # (batch, heads_q, seqlen_q)
        weights = torch.exp(lse_part.double() - lse).nan_to_num(0.0)
        o = (weights[..., None] * o_part).sum(0)  # (batch, heads_q, seqlen_q, head_dim)
        for b in range(p.batch):
            self._decode_write(p, b, o[b].transpose(0, 1), lse[b])


def install(monkeypatch, arch: str = "sm_90", dtype: torch.dtype = torch.bfloat16) -> StandInGpu:
    """Send ``attention()`` on ``dtype`` CPU tensors down the kernel path of a GPU of ``arch`` with stand-in
    kernels (the module docstring says what they check). Plans and repeat calls made before are forgotten;
    the caller forgets the stand-ins' own with ``ops.clear_plans()`` when it is done."""
    gpu = StandInGpu(dtype, arch)
    facts = _FACTS[arch]
    monkeypatch.setattr(dispatch, "wants_kernel", lambda q: True)
    monkeypatch.setattr(ops, "cuda_unavailable_reason", lambda q: None)
    for module in (forward, backward):
        monkeypatch.setattr(module, "device_facts", lambda index: facts)
        monkeypatch.setattr(module, "device_arch", lambda index: arch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(plans, "driver_version", lambda: 13000)  # (a CUDA 13 driver: programmatic launches)
    monkeypatch.setattr(
        forward,
        "get_kernel",
        lambda cfg, causal, arch_, trace=False, window=False, score=None, **kw: _Kernel(
            gpu, "forward", causal, FwdTmaParams if cfg.warp_specialized else FwdParams, window, score
        ),
    )

    def backward_kernels(cfg, arch_, window=False, score=None, ranged=False, dropout=False):
        gpu.backward_builds.append((cfg.name(), arch_, window, score, ranged, dropout))
        return _BackwardKernels(gpu, window, score, cfg.tma_loads)

    def prefetch(cfg, arch_, window=False, score=None, ranged=False, dropout=False):
        gpu.prefetched.append((cfg.name(), arch_, window, score, ranged, dropout))

    monkeypatch.setattr(backward, "get_bwd_kernels", backward_kernels)
    # The backward's compile started ahead of a training call's forward (ops.backward.prefetch): recorded,
    # never compiled (these kernels are stand-ins).
    monkeypatch.setattr(backward.jit_cache, "prefetch", prefetch)
    # The decode family (ops/decode.py imports its device facts by name).
    monkeypatch.setattr(decode, "device_arch", lambda index: arch)
    monkeypatch.setattr(decode, "sm_count", lambda index: 132)
    monkeypatch.setattr(decode, "current_stream", lambda index: 0)
    monkeypatch.setattr(decode, "cuda_unavailable_reason", lambda q: None)
    monkeypatch.setattr(decode, "get_decode_kernels", lambda cfg, arch_: _DecodeKernels(gpu, cfg))
    monkeypatch.setattr(decode, "_capturing", lambda device: False)
    monkeypatch.setattr(decode, "_stream_buffers", {})
    monkeypatch.setattr(decode, "_plans", plans.PlanCache())
    monkeypatch.setattr(tma, "encode_into", _encode)
    for module in (plans, backward):
        monkeypatch.setattr(module, "current_stream", lambda index: 0)
    monkeypatch.setattr(driver, "make_primary_current", lambda index: None)
    monkeypatch.setattr(driver, "primary_context", lambda index: _PRIMARY)
    try:
        lib = host.load(connect_driver=False)
    except host.HostLibraryUnavailable:
        lib = None  # training takes the Python autograd function, which launches through Kernel.launch
    if lib is not None:
        gpu.install_driver(lib)
    monkeypatch.setattr(host, "ops_or_none", lambda: lib)
    ops.clear_plans()  # (the caller clears them again after: they hold stand-in kernels)
    return gpu


@pytest.fixture(params=["python", "native"], name="gpu")
def repeat_mode_gpu(request, monkeypatch):
    """The sm_90 stand-in GPU (the fixture ``gpu`` of a module that imports this), with plans launching from
    Python or as the host library's calls (``FLASH_ATTENTION_REPEAT_CALLS=native``; skipped where the library
    cannot be built). The plans it made are forgotten after the test."""
    monkeypatch.setattr(repeat, "MODE", request.param)
    stand_in = install(monkeypatch, "sm_90")
    if request.param == "native" and host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    yield stand_in
    ops.clear_plans()
