"""The compiled host library (``csrc/host/training_node.cpp``, :mod:`flash_attention.jit.host`) on CPU.

The library's training node launches through function pointers it is handed, so these tests hand it Python
stand-ins for the driver whose "kernels" do the backward's work on CPU tensors at the addresses in the params
struct: the preprocessing stand-in writes delta into the workspace, the dK/dV stand-in reads it back and
writes dK, dV and the fp32 dQ accumulator (or dQ itself in deterministic mode), the cast stand-in turns the
accumulator into dQ. Gradients come out right only if the node wrote every pointer where the params layout
says, sized and split the workspace as the Python plan says, and launched in order; they are checked against
float64 autograd through the reference. The real kernels behind the node are tested on the GPU
(tests/test_gpu_autograd.py).
"""

from __future__ import annotations

import ctypes
import gc
import os
import zlib

import pytest
import torch

from flash_attention.fallback.reference import attention_reference
from flash_attention.jit import driver, host
from flash_attention.jit.params import BwdParams
from flash_attention.ops import plans
from flash_attention.ops.training import _OFFSETS


@pytest.fixture(scope="module")
def host_ops():
    try:
        return host.load(connect_driver=False)
    except host.HostLibraryUnavailable as exc:
        if host._compiler() is not None and os.environ.get(host.ENV) != "0":
            # (a compiler that cannot build it is a failure: a header of another PyTorch version once
            # broke the build, and the skips hid every native path)
            pytest.fail(f"the host library did not build: {exc}")
        pytest.skip(f"no host library here: {exc}")


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


_INSTALLED = None  # the stand-in driver the library was last handed
_PROGRAMS: list = []

PRE, DKDV, CONVERT, DQ = 0x1001, 0x1002, 0x1003, 0x1004  # stand-in kernel handles
PRIMARY, CALLERS = 0xC0FFEE, 0xBEEF  # stand-in contexts: the program's, and the one current before


def _at(address: int, shape, strides, dtype) -> torch.Tensor:
    """A CPU tensor viewing memory at ``address`` (what a kernel sees through a pointer)."""
    if address == 0:
        raise AssertionError("a kernel was handed a null pointer")
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    size = torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * (span * size)).from_address(address)
    return torch.frombuffer(buf, dtype=dtype).as_strided(shape, strides)


class StandInDriver:
    """The driver entry points, with CPU stand-ins for the four backward kernels (see the module doc)."""

    def __init__(self, dtype=torch.float32, fail_on: int | None = None, launch_ex: bool = True):
        self.dtype, self.fail_on, self.with_launch_ex = dtype, fail_on, launch_ex
        # (kernel, grid, block, smem, stream, context, params, programmatic), one per launch
        self.launches: list[tuple] = []
        self.current = CALLERS
        self.errors: list[BaseException] = []
        self._keep = ()  # the C functions of the last install: they live as long as this object

    def install(self, host_ops) -> None:
        global _INSTALLED
        self._keep = host.set_stand_in_driver(
            host_ops, self._launch, self._ctx_get, self._ctx_set, self._error, None,
            self._launch_ex if self.with_launch_ex else None,
        )  # fmt: skip
        _INSTALLED = self  # the library keeps the C pointers: their Python objects must outlive the test

    def _ctx_get(self, out):
        out[0] = self.current
        return 0

    def _ctx_set(self, ctx):
        self.current = ctx
        return 0

    def _error(self, status, text):
        text[0] = b"stand-in failure"
        return 0

    def _launch_ex(self, config, kernel, args, extra):
        # cuLaunchKernelEx: the launch's shape from its config; programmatic when its one attribute is the
        # programmatic-serialization flag, set.
        c = config.contents
        attrs = [(c.attrs[i].id, c.attrs[i].value) for i in range(c.num_attrs)]
        if attrs not in ([], [(driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)]):
            self.errors.append(AssertionError(f"unexpected launch attributes {attrs}"))
            return 999
        shape = (*c.grid, *c.block, c.smem, c.stream)
        return self._launch(kernel, *shape, args, extra, programmatic=bool(attrs))

    def _launch(self, kernel, gx, gy, gz, bx, by, bz, smem, stream, args, extra, programmatic=False):
        p = BwdParams.from_buffer_copy((ctypes.c_char * ctypes.sizeof(BwdParams)).from_address(args[0]))
        launch = (kernel, (gx, gy, gz), (bx, by, bz), smem, stream, self.current, p, programmatic)
        self.launches.append(launch)
        if kernel == self.fail_on:
            return 700
        try:
            self._run(kernel, p)
        except BaseException as exc:  # (raised inside a C callback: reported through the status instead)
            self.errors.append(exc)
            return 999
        return 0

    def _tensors(self, p):
        b, sq, sk, hq, hkv, d = p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim

        def t(ptr, prefix, s, h):
            strides = tuple(getattr(p, f"{prefix}_{n}_stride") for n in ("batch", "row", "head")) + (1,)
            return _at(ptr, (b, s, h, d), strides, self.dtype)

        return {
            "q": t(p.q, "q", sq, hq), "k": t(p.k, "k", sk, hkv), "v": t(p.v, "v", sk, hkv),
            "o": t(p.o, "o", sq, hq), "do": t(p.dout, "do", sq, hq),
            "dq": t(p.dq, "dq", sq, hq), "dk": t(p.dk, "dk", sk, hkv), "dv": t(p.dv, "dv", sk, hkv),
        }  # fmt: skip

    def _rows(self, ptr, p):
        return _at(ptr, (p.batch, p.heads_q, p.seqlen_q_pad), (p.heads_q * p.seqlen_q_pad, p.seqlen_q_pad, 1),
                   torch.float32)  # fmt: skip

    def _run(self, kernel, p):
        x = self._tensors(p)
        if kernel == PRE:
            delta = (x["do"].double() * x["o"].double()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
            self._rows(p.delta, p)[:, :, : p.seqlen_q] = delta.float()
            if p.dq_accum:
                self._accum(p).zero_()
            return
        q, k, v = (x[n].double().requires_grad_() for n in "qkv")
        with torch.enable_grad():  # (the engine runs a backward node with grad mode off)
            out, _ = attention_reference(q, k, v, causal=False, softmax_scale=p.scale)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), x["do"].double())
        delta = (x["do"].double() * out.detach()).sum(-1).transpose(1, 2)
        # The stand-ins depend on the preprocessing kernel's output as the real ones do.
        torch.testing.assert_close(
            self._rows(p.delta, p)[:, :, : p.seqlen_q].double(), delta, rtol=1e-5, atol=1e-5
        )
        if kernel == DKDV:
            x["dk"].copy_(dk)
            x["dv"].copy_(dv)
            if p.dq_accum:
                self._accum(p)[:, :, : p.seqlen_q, :] = dq.transpose(1, 2).float()
        elif kernel == CONVERT:
            x["dq"].copy_(self._accum(p)[:, :, : p.seqlen_q, :].transpose(1, 2))
        elif kernel == DQ:
            x["dq"].copy_(dq)

    def _accum(self, p):
        shape = (p.batch, p.heads_q, p.seqlen_q_pad, p.head_dim)
        strides = (p.heads_q * p.seqlen_q_pad * p.head_dim, p.seqlen_q_pad * p.head_dim, p.head_dim, 1)
        return _at(p.dq_accum, shape, strides, torch.float32)


def _program(host_ops, q, k, scale, deterministic, bound_offsets=()):
    """A BackwardProgram as ops.training makes one from a plan, with stand-in kernels."""
    p = BwdParams()
    for prefix, t in (("q", q), ("k", k), ("v", k), ("o", q), ("do", q), ("dq", q), ("dk", k), ("dv", k)):
        plans.fill_contiguous_strides(p, prefix, tuple(t.shape))
    p.lse_batch_stride, p.lse_head_stride = q.shape[2] * q.shape[1], q.shape[1]
    plans.fill_common(p, q, k, 64, scale, 0.0)
    p.seqlen_q_pad = -(-q.shape[1] // 128) * 128
    stats = q.shape[0] * q.shape[2] * p.seqlen_q_pad
    accum = 0 if deterministic else stats * q.shape[3]
    # (the last field: queued programmatically, as a Hopper plan's dK/dV and last launches are)
    last = (DQ, 3, 2, 1, 256, 4096, 1) if deterministic else (CONVERT, 1, 2, 2, 128, 0, 1)
    launches = [PRE, 2, 2, 2, 128, 0, 0, DKDV, 5, 1, 2, 384, 99000, 1, *last]
    names = "pre_kernel\ndkdv_kernel\n" + ("dq_kernel" if deterministic else "convert_kernel")
    template = torch.frombuffer(bytearray(bytes(p)), dtype=torch.uint8)
    program = torch.classes.flash_attention_host.BackwardProgram(
        template, _OFFSETS, launches, names, stats, accum, PRIMARY, list(bound_offsets), [], []
    )
    _PROGRAMS.append(program)  # record_training takes its address: the caller keeps it alive (a plan does)
    return program.address()


def _recorded_call(host_ops, b=2, sq=37, sk=45, hq=4, hkv=2, d=16, deterministic=False, grads=(True,) * 3):
    """q, k, v and an out recorded by the node (out filled with the reference forward, as the forward kernel
    would have written it)."""
    q, k, v = (
        torch.randn(b, s, h, d).requires_grad_(g)
        for (s, h), g in zip(((sq, hq), (sk, hkv), (sk, hkv)), grads, strict=True)
    )
    scale = d**-0.5
    with torch.no_grad():
        out, lse = attention_reference(q, k, v, causal=False, softmax_scale=scale)
    out, lse = out.float().contiguous(), lse.float()
    host_ops.record_training(q, k, v, out, lse, None, 0, _program(host_ops, q, k, scale, deterministic), [])
    return q, k, v, out, scale


def _reference_grads(q, k, v, scale, dout):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_reference(q64, k64, v64, causal=False, softmax_scale=scale)
    return torch.autograd.grad(out, (q64, k64, v64), dout.double())


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_nodes_backward_launches_the_program_with_this_calls_tensors(host_ops, deterministic):
    drv = StandInDriver()
    drv.install(host_ops)
    q, k, v, out, scale = _recorded_call(host_ops, deterministic=deterministic)
    assert out.grad_fn.name() == "FlashAttentionBackward" and out.requires_grad
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert not drv.errors, drv.errors
    for got, want in zip((dq, dk, dv), _reference_grads(q, k, v, scale, dout), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    kernels = [launch[0] for launch in drv.launches]
    assert kernels == [PRE, DKDV, DQ if deterministic else CONVERT]
    assert drv.launches[1][1:4] == ((5, 1, 2), (384, 1, 1), 99000)
    assert all(launch[5] == PRIMARY for launch in drv.launches)  # launched in the program's context
    # The program's programmatic launches go through cuLaunchKernelEx with the attribute, the first as before.
    assert [launch[7] for launch in drv.launches] == [False, True, True]
    assert drv.current == CALLERS  # and the caller's context put back
    p = drv.launches[0][6]
    assert (p.q, p.k, p.v, p.o) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    assert (p.dq, p.dk, p.dv) == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert (p.dq_accum is None) == deterministic and p.key_range is None


def test_programmatic_launches_are_ordinary_ones_on_a_driver_without_launch_ex(host_ops):
    # A driver before CUDA 12.0 has no cuLaunchKernelEx: the program's launches all go through
    # cuLaunchKernel, in order, and the gradients are the same (the kernels' grid-dependency waits then
    # return at once).
    drv = StandInDriver(launch_ex=False)
    drv.install(host_ops)
    q, k, v, out, scale = _recorded_call(host_ops)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert not drv.errors, drv.errors
    queued = [(launch[0], launch[7]) for launch in drv.launches]
    assert queued == [(PRE, False), (DKDV, False), (CONVERT, False)]
    for got, want in zip(grads, _reference_grads(q, k, v, scale, dout), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_a_gradient_in_another_layout_is_copied_for_the_kernels(host_ops):
    drv = StandInDriver()
    drv.install(host_ops)
    q, k, v, out, scale = _recorded_call(host_ops)
    weights = torch.randn(out.shape[-1])
    (out * weights).sum().backward()  # dO arrives as a stride-0 expand
    assert not drv.errors, drv.errors
    dout = weights.expand(out.shape)
    for got, want in zip((q.grad, k.grad, v.grad), _reference_grads(q, k, v, scale, dout), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_inputs_without_grad_get_none(host_ops):
    StandInDriver().install(host_ops)
    q, k, v, out, _ = _recorded_call(host_ops, grads=(True, False, True))
    out.sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


def test_nothing_is_recorded_when_no_input_requires_grad(host_ops):
    StandInDriver().install(host_ops)
    _, _, _, out, _ = _recorded_call(host_ops, grads=(False, False, False))
    assert out.grad_fn is None and not out.requires_grad


def test_modifying_the_output_in_place_before_backward_is_an_error(host_ops):
    drv = StandInDriver()
    drv.install(host_ops)
    _, _, _, out, _ = _recorded_call(host_ops)
    loss = out.sum()
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert drv.launches == []


def test_a_second_backward_needs_retain_graph(host_ops):
    StandInDriver().install(host_ops)
    q, _, _, out, _ = _recorded_call(host_ops)
    loss = (out * torch.randn_like(out)).sum()
    (first,) = torch.autograd.grad(loss, q, retain_graph=True)
    (second,) = torch.autograd.grad(loss, q)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(loss, q)


def test_differentiating_the_gradients_again_is_refused(host_ops):
    StandInDriver().install(host_ops)
    q, _, _, out, _ = _recorded_call(host_ops)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="not implemented"):
        dq.sum().backward()


def test_a_failed_launch_names_the_kernel_and_restores_the_context(host_ops):
    drv = StandInDriver(fail_on=DKDV)
    drv.install(host_ops)
    _, _, _, out, _ = _recorded_call(host_ops)
    with pytest.raises(RuntimeError, match=r"launching dkdv_kernel failed: stand-in failure \(700\)"):
        out.sum().backward()
    assert [launch[0] for launch in drv.launches] == [PRE, DKDV]
    assert drv.current == CALLERS


def test_a_program_checks_what_it_is_given(host_ops):
    program = torch.classes.flash_attention_host.BackwardProgram
    params = torch.zeros(ctypes.sizeof(BwdParams), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="offsets"):
        program(params, _OFFSETS[:-1], [PRE, 1, 1, 1, 128, 0, 0], "pre", 1, 0, PRIMARY, [], [], [])
    with pytest.raises(RuntimeError, match="outside the params"):
        program(
            params,
            [*_OFFSETS[:-1], ctypes.sizeof(BwdParams) - 2],
            [PRE, 1, 1, 1, 128, 0, 0],
            "pre",
            1,
            0,
            1,
            [],
            [],
            [],
        )
    with pytest.raises(RuntimeError, match="seven integers"):
        program(params, _OFFSETS, [PRE, 1, 1], "pre", 1, 0, PRIMARY, [], [], [])
    with pytest.raises(RuntimeError, match="uint8"):
        program(params.float(), _OFFSETS, [PRE, 1, 1, 1, 128, 0, 0], "pre", 1, 0, PRIMARY, [], [], [])
    pre = [PRE, 1, 1, 1, 128, 0, 0]
    with pytest.raises(RuntimeError, match="outside the params"):  # a tensor map past the params' end
        program(params, _OFFSETS, pre, "pre", 1, 0, PRIMARY, [], [len(params), *[1] * 11] * 2, [0] * 5)
    with pytest.raises(RuntimeError, match="none, or q's and dO's"):
        program(params, _OFFSETS, pre, "pre", 1, 0, PRIMARY, [], [0, *[1] * 11], [0] * 5)
    with pytest.raises(RuntimeError, match="null entry point"):
        host_ops.set_driver(0, 1, 1, 1, 0, 0)


def test_a_calls_bound_tensors_reach_the_programs_bound_offsets(host_ops):
    # A variant's pointers (ALiBi's slopes, a packed batch's runs): each call binds its own tensors, which the
    # node keeps alive and writes where the program says; the count must match the program's.
    drv = StandInDriver()
    drv.install(host_ops)
    fields = ("alibi_slopes", "row_keys", "key_rows")
    q, k, v = (torch.randn(2, s, h, 16, requires_grad=True) for s, h in ((37, 4), (45, 2), (45, 2)))
    with torch.no_grad():
        out, lse = attention_reference(q, k, v, causal=False, softmax_scale=0.25)
    out, lse = out.float().contiguous(), lse.float()
    address = _program(host_ops, q, k, 0.25, False, [getattr(BwdParams, f).offset for f in fields])
    with pytest.raises(RuntimeError, match="2 bound tensors for a program that takes 3"):
        host_ops.record_training(q, k, v, out, lse, None, 0, address, [torch.zeros(4), torch.zeros(4)])
    bound = [torch.randn(4), torch.zeros(37, 2, dtype=torch.int32), torch.zeros(45, 2, dtype=torch.int32)]
    addresses = [t.data_ptr() for t in bound]
    host_ops.record_training(q, k, v, out, lse, None, 0, address, bound)
    del bound  # the node holds its own references
    gc.collect()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not drv.errors, drv.errors
    for launch in drv.launches:
        p = launch[6]
        assert [getattr(p, f) for f in fields] == addresses


def test_record_refuses_an_address_that_is_not_a_program(host_ops):
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    out, lse = torch.empty(1, 8, 2, 16), torch.empty(1, 2, 8)
    not_a_program = torch.zeros(64, dtype=torch.uint8)  # mapped memory without the program's mark
    for address in (0, not_a_program.data_ptr()):
        with pytest.raises(RuntimeError, match="not the address of a BackwardProgram"):
            host_ops.record_training(q, k, v, out, lse, None, 0, address, [])
    assert out.grad_fn is None


def test_the_node_keeps_its_program_alive(host_ops):
    drv = StandInDriver()
    drv.install(host_ops)
    q, k, v, out, _ = _recorded_call(host_ops)
    _PROGRAMS.clear()  # the only Python reference to the program: the node holds its own
    gc.collect()
    out.sum().backward()
    assert not drv.errors and [launch[0] for launch in drv.launches] == [PRE, DKDV, CONVERT]


def test_the_slot_offsets_are_the_params_fields():
    names = (
        "q",
        "k",
        "v",
        "o",
        "dout",
        "lse",
        "lse_log2",
        "delta",
        "dq_accum",
        "dq",
        "dk",
        "dv",
        "key_range",
    )
    assert _OFFSETS[: len(names)] == [getattr(BwdParams, n).offset for n in names]
    assert _OFFSETS[-1] == BwdParams.dropout_key.offset and BwdParams.dropout_key.size == 4
    # The node writes the slots in this order (training_node.cpp's Slot enum).
    enum = (host.source_path() / "training_node.h").read_text().split("enum Slot : int {")[1].split("}")[0]
    listed = [s.strip() for s in enum.replace("\n", " ").split(",") if s.strip()]
    camel = ["k" + "".join(w.capitalize() for w in n.split("_")) for n in (*names, "dropout_key")]
    assert listed == [*camel, "kNumSlots"]


def test_any_failure_to_build_or_load_means_the_python_path(monkeypatch):
    def broken():
        raise ImportError("no module named setuptools")

    monkeypatch.setattr(host, "_state", {})
    monkeypatch.setattr(host, "_load", broken)
    assert host.unavailable_reason() == "no module named setuptools"
    with pytest.raises(host.HostLibraryUnavailable):
        host.load()


def test_without_a_compiler_the_library_reports_why(monkeypatch):
    monkeypatch.setattr(host, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    reason = host.unavailable_reason()
    assert reason is not None and "no C++ compiler" in reason
    with pytest.raises(host.HostLibraryUnavailable, match="no C\\+\\+ compiler"):
        host.load()
    monkeypatch.setattr(host, "_state", {})
    monkeypatch.setenv(host.ENV, "0")
    assert host.unavailable_reason() == f"{host.ENV}=0"


@pytest.fixture
def fresh_host(monkeypatch, tmp_path):
    """The host module as a fresh process sees it, with a stand-in compiler whose build waits for `release`
    and then writes the library's file, and a stand-in load: (release, built, loaded, listened, stderr)."""
    import threading

    release, built, loaded, listened = threading.Event(), [], [], []
    target = tmp_path / "host" / "host_library-test.so"
    monkeypatch.setattr(host, "_state", {})
    monkeypatch.setattr(host, "_ready_listeners", [lambda: listened.append(True)])
    monkeypatch.setattr(host, "_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(host, "_library_path", lambda cxx: target)
    monkeypatch.delenv(host.ENV, raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_QUIET", raising=False)

    def build(cxx, path):
        assert release.wait(30), "the test never released the build"
        built.append(threading.current_thread().name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"library")

    def load():
        if not target.exists():  # what the real _load would do: build in this thread
            build("/usr/bin/c++", target)
        loaded.append(True)
        return "the library's ops"

    monkeypatch.setattr(host, "_build", build)
    monkeypatch.setattr(host, "_load", load)
    monkeypatch.setattr(host, "_connect_driver", lambda ops: None)
    return release, built, loaded, listened


def test_a_first_call_does_not_wait_for_the_host_library(fresh_host, capsys):
    import time

    release, built, loaded, listened = fresh_host
    t0 = time.perf_counter()
    assert host.ops_or_none() is None  # the Python path, at once
    assert host.ops_or_none() is None  # still building: no second build
    assert time.perf_counter() - t0 < 5 and not built and not loaded
    assert "building the host library" in capsys.readouterr().err
    release.set()
    assert host.wait_for_background_build(30)
    assert built == ["flash_attention host library"]  # built in the background thread, once
    assert "host library built in" in capsys.readouterr().err
    assert host.ops_or_none() == "the library's ops"
    assert listened == [True]  # the caches that chose the Python path meanwhile are told, once
    assert host.ops_or_none() == "the library's ops" and listened == [True] and loaded == [True]


def test_a_failed_background_build_leaves_the_python_path_with_one_warning(fresh_host, monkeypatch):
    release, built, loaded, listened = fresh_host

    def failing(cxx, path):
        raise host.HostLibraryUnavailable("c++ could not compile training_node.cpp (exit 1)")

    monkeypatch.setattr(host, "_build", failing)
    assert host.ops_or_none() is None
    assert host.wait_for_background_build(30)
    with pytest.warns(RuntimeWarning, match="could not compile training_node.cpp"):
        assert host.ops_or_none() is None
    assert host.ops_or_none() is None and not loaded and not listened


def test_a_library_on_disk_or_asked_for_is_loaded_at_once(fresh_host, monkeypatch):
    release, built, loaded, listened = fresh_host
    # FLASH_ATTENTION_HOST_LIBRARY=wait: the build runs in the caller's thread (the old behaviour).
    monkeypatch.setenv(host.ENV, "wait")
    release.set()
    assert host.ops_or_none() == "the library's ops"
    assert built == ["MainThread"] and not listened
    # A library already built (a later process): loaded by the first call, no thread.
    monkeypatch.delenv(host.ENV)
    monkeypatch.setattr(host, "_state", {})
    assert host.ops_or_none() == "the library's ops" and built == ["MainThread"]


def test_the_launch_layers_caches_forget_their_python_choices_when_the_library_arrives():
    from flash_attention.ops import decode, repeat

    assert repeat.clear in host._ready_listeners and decode.clear_plans in host._ready_listeners
