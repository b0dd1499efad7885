"""The cached launch path (kernels/launch.py), which only GPUs take.

On CPU, with a stand-in for Triton's compiled kernel, what the Launcher itself decides: the
kernel's arguments in signature order, constexprs built only to compile, which changes make a new
compile, which positions are read again. What it hands Triton's C launcher before those arguments
(Triton's ABI) a stand-in cannot show: on CPU it is compared with the launch call in the installed
Triton's source; on a GPU (``-m gpu``) with what Triton's own launch passes, call for call.
"""
import inspect
import struct
import re
import types

import pytest
import torch
import triton
import triton.language as tl

import dist_util
import moe_ep.kernels.launch as L
from moe_ep.native.launch import LaunchPlan


@triton.jit(do_not_specialize=["n"])
def _k(a_ptr, b_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


class _Compiled:
    function, packed_metadata = 7, (1, 2)
    src = types.SimpleNamespace(signature={"a_ptr": "*fp32", "b_ptr": "*i32", "n": "i32", "BLOCK": "constexpr",
                                           "FLAG": "constexpr"})

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@pytest.fixture
def fake_gpu(monkeypatch):
    compiled = []

    class _Jit:  # what kernel[grid] returns: the compiled kernel (after launching it)
        arg_names, fn = _k.arg_names, _k.fn

        def __getitem__(self, grid):
            def go(*args, **consts):
                c = _Compiled()
                compiled.append((grid, args, consts, c))
                return c
            return go

    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setenv("MOE_EP_LAUNCH", "triton")  # the stand-in has no CUfunction: Triton's launcher path
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1000 + dev, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_GLOBAL", L.Launcher())
    return compiled, _Jit()


def test_cached_launch_passes_raw_args_in_signature_order(fake_gpu):
    compiled, fn = fake_gpu
    la = L.Launcher(torch.device("cuda", 3))
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    built = []

    def consts():
        built.append(1)
        return dict(FLAG=True, BLOCK=16)  # deliberately not in signature order

    la(("k",), fn, 3, (a, b, 5), consts)             # first: compiles through kernel[grid]
    assert len(compiled) == 1 and compiled[0][0] == (3,) and compiled[0][2] == dict(FLAG=True, BLOCK=16)
    la(("k",), fn, 3, (a, b, 9), consts)             # then: straight to the C launcher
    assert len(compiled) == 1 and len(built) == 1    # constexprs are not even built again
    call = compiled[0][3].calls[-1]
    assert call[:9] == L.leading_args(compiled[0][3], 3, 1003)          # the buffer's device's stream
    assert call[9:] == (a.data_ptr(), b.data_ptr(), 9, 16, True)        # signature order, constexprs last


@triton.jit
def _k_default(a_ptr, b_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def test_constexprs_by_name_with_the_kernels_defaults(fake_gpu):
    """A kernel takes the constexprs it declares from a dict that may serve another kernel too
    (Triton refuses an unknown keyword on a GPU, the interpreter ignores it), and the defaults of
    those the caller leaves out are replayed too."""
    compiled, fn = fake_gpu
    fn.arg_names, fn.fn = _k_default.arg_names, _k_default.fn
    la = L.Launcher(torch.device("cuda", 0))
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    la(("d",), fn, 3, (a, b, 5), dict(BLOCK=16, OTHER_HALF=1))
    assert compiled[0][2] == dict(BLOCK=16, FLAG=False)
    la(("d",), fn, 3, (a, b, 6), dict(BLOCK=16, OTHER_HALF=1))
    assert compiled[0][3].calls[-1][9:] == (a.data_ptr(), b.data_ptr(), 6, 16, False)


def test_keys_decide_compiles(fake_gpu):
    compiled, fn = fake_gpu
    la = L.Launcher(torch.device("cuda", 0))
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    la(("x", 1), fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True))
    la(("x", 2), fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True))   # another key: another compile
    la(("x", 1), fn, 3, (a, b, 6), dict(BLOCK=16, FLAG=True))   # same key: none
    assert len(compiled) == 2
    assert L.Launcher(torch.device("cuda", 0))._plans == {}     # caches are per launcher (per buffer)


def test_global_launch_keys_on_every_argument(fake_gpu):
    compiled, fn = fake_gpu
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    L.launch(fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True))
    L.launch(fn, 4, (a, b, 5), dict(BLOCK=16, FLAG=True))          # grid
    L.launch(fn, 3, (a, b, 5), dict(BLOCK=32, FLAG=True))          # constexpr
    L.launch(fn, 3, (a[1:], b, 5), dict(BLOCK=16, FLAG=True))      # pointer no longer 16-byte aligned
    L.launch(fn, 3, (a, b.long(), 5), dict(BLOCK=16, FLAG=True))   # pointer dtype
    L.launch(fn, 3, (a, b, 2**40), dict(BLOCK=16, FLAG=True))      # int needs 64 bits
    assert len(compiled) == 6
    L.launch(fn, 3, (a, b, 77), dict(BLOCK=16, FLAG=True))         # same code: no compile
    assert len(compiled) == 6


def test_only_dynamic_positions_are_read_again(fake_gpu):
    compiled, fn = fake_gpu
    la = L.Launcher(torch.device("cuda", 0))
    a, b, c = torch.zeros(64), torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    la(("k",), fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True), dynamic=(0, 2))
    la(("k",), fn, 3, (torch.zeros(64), c, 6), dict(BLOCK=16, FLAG=True), dynamic=(0, 2))
    call = compiled[0][3].calls[-1]
    assert call[10] == b.data_ptr() and call[11] == 6  # position 1 is fixed: read when compiled


def test_leading_arguments_are_those_of_tritons_own_launch():
    """The installed Triton launches a compiled kernel with TRITON_LEADING, then the arguments:
    a Triton whose launch call differs fails here (and the GPU test below fails on the device)."""
    src = inspect.getsource(triton.runtime.jit.JITFunction.run)
    m = re.search(r"kernel\.run\(([^()]*)\*bound_args\.values\(\)\)", src)
    assert m, "triton's JITFunction.run no longer calls kernel.run(..., *bound_args.values())"
    names = tuple(n.strip() for n in m.group(1).split(",") if n.strip())
    assert names == L.TRITON_LEADING, names
    assert len(L.leading_args(_Compiled(), 5, 0)) == len(L.TRITON_LEADING)


@triton.jit(do_not_specialize=["n"])
def _axpb(x_ptr, y_ptr, n, BLOCK: tl.constexpr, ADD: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i) * n + ADD)


@pytest.mark.gpu
def test_cached_launch_matches_tritons_launch_gpu(monkeypatch):
    """Triton's own launch and the Launcher's cached one (MOE_EP_LAUNCH=triton: through Triton's
    launcher) hand CompiledKernel.run the same values (but for launch metadata and hooks), and the
    cached launch computes the right thing."""
    if dist_util.cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("MOE_EP_LAUNCH", "triton")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    x = torch.arange(64, dtype=torch.float32, device=dev)
    y1, y2 = torch.empty_like(x), torch.empty_like(x)
    consts = dict(BLOCK=64, ADD=1.0)
    kernel = _axpb[(1,)](x, y1, 3, **consts)
    calls = []
    run = kernel.run  # loads the kernel; CompiledKernel.run is a property over _run
    kernel._run = lambda *a: (calls.append(a), run(*a))[1]
    _axpb[(1,)](x, y1, 5, **consts)                        # Triton's launch (cached compile)
    la = L.Launcher(dev)
    la(("axpb",), _axpb, 1, (x, y2, 3), consts)             # first: through kernel[grid] (the same kernel)
    la(("axpb",), _axpb, 1, (x, y2, 5), consts)             # then: straight to CompiledKernel.run
    torch.cuda.synchronize()
    outs = (y1.data_ptr(), y2.data_ptr())  # Triton's launch wrote y1, ours y2: the same argument

    def raw(call):
        vals = (a.data_ptr() if isinstance(a, torch.Tensor) else a for a in call)
        return tuple("y" if isinstance(v, int) and v in outs else v for v in vals)
    theirs, ours = raw(calls[0]), raw(calls[-1])
    assert len(calls) == 3 and len(theirs) == len(ours)
    assert theirs[:6] == ours[:6]                          # grid, stream, function, metadata
    assert theirs[9:] == ours[9:]                          # the arguments (tensors as addresses), constexprs
    assert torch.equal(y2, x * 5 + 1) and torch.equal(y1, y2)


# ---------------------------------------------------------------------------- the native path
def _triton_param_types(signature: dict) -> list:
    """The C types of the parameters Triton's own launcher hands cuLaunchKernel for ``signature``
    (read from the source its make_launcher generates: the ``params`` array and the declarations
    of ``_launch``)."""
    from triton.backends.nvidia.driver import make_launcher

    src = make_launcher({}, signature, None)
    decl = re.search(r"static void _launch\(([^)]*)\)", src).group(1)
    types_of = {name: ty for ty, name in (d.strip().rsplit(" ", 1) for d in decl.split(","))}
    params = re.search(r"void \*params\[\] = \{([^}]*)\}", src).group(1)
    return [types_of[p.strip().lstrip("&")] for p in params.split(",") if p.strip()]


_C_SIZES = {"CUdeviceptr": 8, "int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2, "int32_t": 4, "uint32_t": 4,
            "int64_t": 8, "uint64_t": 8}

_SIGNATURES = [
    {"x": "*bf16", "y": "*fp32", "T": "i32", "BLOCK": "constexpr"},
    {"a": "*u8", "n": "i64", "flag": "i1", "C": "constexpr", "s": "fp32", "h": "bf16", "q": "u16", "r": "i8"},
    {"only": "constexpr"},
    {"p": "*i64", "q": "*i32", "w": "fp16", "d": "fp64", "u": "u32", "v": "u64", "k": "i16", "b": "u8"},
]


@pytest.mark.parametrize("sig", _SIGNATURES, ids=range(len(_SIGNATURES)))
def test_param_sizes_are_those_of_tritons_launcher(sig):
    """What the native plan packs per parameter is what the installed Triton's launcher passes:
    the same parameters in the same order (constexprs dropped, the two scratch pointers last),
    each of the same size."""
    assert L.param_sizes(list(sig.values())) == [_C_SIZES[t] for t in _triton_param_types(sig)]


def test_param_sizes_refuse_unknown_types():
    with pytest.raises(ValueError, match="signature: no native packing"):
        L.param_sizes(["*fp32", "tensordesc<fp32[16, 16]>"])


def _fake_compiled(signature: dict, **meta):
    md = dict(global_scratch_size=0, profile_scratch_size=0, num_ctas=1, launch_cooperative_grid=False,
              launch_pdl=False, num_warps=4, shared=0)
    md.update(meta)
    # function 0: a native plan that packs but cannot launch (no driver needed)
    return types.SimpleNamespace(src=types.SimpleNamespace(signature=signature), metadata=types.SimpleNamespace(**md),
                                 name="k", function=0, run=None, packed_metadata=(4, 1, 0))


class _Fn:
    arg_names = ["x_ptr", "y_ptr", "T", "ONE", "scale", "flag", "BLOCK"]


_SIG = {"x_ptr": "*bf16", "y_ptr": "*i32", "T": "i32", "ONE": "constexpr", "scale": "fp32", "flag": "i1",
        "BLOCK": "constexpr"}


def test_native_plan_packs_every_parameter_and_patches_the_dynamic_ones():
    """The bytes a native launch hands the driver: each non-constexpr argument at its C alignment
    (struct's native layout), the scratch pointers 0; dynamic arguments re-read per launch; a bound
    launch fixes the other dynamic values at those of the call it was bound from."""
    x, y = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)
    args = (x, y, 5, 1, 0.75, True)
    plan = L.NativePlan(_fake_compiled(_SIG), 3, args, dict(BLOCK=16), (0, 2), _Fn.arg_names)

    def expect(xp, yp, T):
        return struct.pack("@QQifbxxxQQ", xp, yp, T, 0.75, 1, 0, 0)
    assert plan._all.packed([x.data_ptr(), 5]) == expect(x.data_ptr(), y.data_ptr(), 5)
    assert plan._all.packed([x.data_ptr() + 64, 2**31 - 1]) == expect(x.data_ptr() + 64, y.data_ptr(), 2**31 - 1)
    assert plan._all.packed([x.data_ptr(), -3]) == expect(x.data_ptr(), y.data_ptr(), -3)
    bound = plan.bind((x, y, 77, 1, 0.75, True), [0])      # T fixed at 77, x patched per launch
    assert bound.packed([4096]) == expect(4096, y.data_ptr(), 77)
    assert plan.bind((x, y, 77, 1, 0.75, True), [0]) is bound  # kept by what it fixes
    assert plan.bind((x, y, 78, 1, 0.75, True), [0]) is not bound


@triton.jit
def _k_grouped(a_ptr, b_ptr, n, G: tl.constexpr):
    pass


def test_a_constexpr_group_is_compiled_in_not_packed(fake_gpu):
    """A constexpr parameter holding a group (``moe_ep.kernels.args``, what the node kernels take)
    is one constexpr to the launch path: Triton's signature names it ``constexpr`` as it does any
    ``tl.constexpr`` parameter, so a native plan packs the runtime arguments alone, as for the
    kernel without it, and Triton's launcher gets the group itself as that parameter's value."""
    from moe_ep.kernels.args import CombineTiles, constexprs
    grp = constexprs(CombineTiles, dict(BLOCK_T=16, BLOCK_K=8, BLOCK_H=512, BLOCK_HR=512, BLOCK_TR=16, STAGES=2))
    assert all(isinstance(v, tl.constexpr) for v in grp) and grp.BLOCK_H == 512
    x, y = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)
    sig = {"a_ptr": "*bf16", "b_ptr": "*i32", "n": "i32", "G": "constexpr"}
    plan = L.NativePlan(_fake_compiled(sig), 3, (x, y, 5), dict(G=grp), (0, 2), _k_grouped.arg_names)
    assert plan._all.packed([x.data_ptr(), 6]) == struct.pack("@QQixxxxQQ", x.data_ptr(), y.data_ptr(), 6, 0, 0)
    compiled, fn = fake_gpu
    fn.arg_names, fn.fn = _k_grouped.arg_names, _k_grouped.fn
    la = L.Launcher(torch.device("cuda", 0))
    la(("g",), fn, 3, (x, y, 5), dict(G=grp, OTHER=1))
    assert compiled[0][2] == dict(G=grp)
    la(("g",), fn, 3, (x, y, 7), dict(G=grp))
    assert compiled[0][3].calls[-1][9:] == (x.data_ptr(), y.data_ptr(), 7, grp)


def test_constexprs_names_a_missing_field():
    """``constexprs`` refuses a group with a field neither given nor defaulted, by name, and gives
    plain values for the interpreter."""
    from moe_ep.kernels.args import CombineModes, constexprs
    given = dict(BASE_F32=False, WEIGHTS=True, ROWS=False, OWN_Y=True, WIN=False, WOUT=False)
    with pytest.raises(KeyError, match="INTERP"):
        constexprs(CombineModes, given)
    plain = constexprs(CombineModes, dict(given, INTERP=True), compiled=False)
    assert plain.WEIGHTS is True and plain.XROWS is False and not isinstance(plain.INTERP, tl.constexpr)


def test_node_groups_hand_the_node_kernel_its_groups():
    """``node_groups`` (the inter-node kernels' ``NODE``) holds a node kernel's four constexpr groups
    as the host built them: each wrapped for a compiled kernel (so ``NODE.DIM`` reads back as the
    ``tl.constexpr`` group the node kernel's ``DIM`` takes, its fields constexprs too), plain for
    the interpreter; a missing group raises KeyError naming it."""
    from moe_ep.kernels.args import CombineTiles, NodeGroups, Offsets, constexprs, node_groups
    tiles = dict(BLOCK_T=16, BLOCK_K=8, BLOCK_H=512, BLOCK_HR=512, BLOCK_TR=16, STAGES=2)
    consts = dict(OFF=constexprs(Offsets, dict(hdr=64)), DIM="dims", MODE="modes", TILE=constexprs(CombineTiles, tiles),
                  BLOCK_T=16)
    g = node_groups(consts)
    assert isinstance(g, NodeGroups) and all(isinstance(v, tl.constexpr) for v in g)
    assert g.TILE.value is consts["TILE"] and isinstance(g.TILE.value.BLOCK_H, tl.constexpr)
    assert g.OFF.value.hdr == 64 and g.DIM.value == "dims"
    plain = node_groups(dict(consts, TILE=constexprs(CombineTiles, tiles, compiled=False)), compiled=False)
    assert plain.MODE == "modes" and plain.TILE.BLOCK_H == 512 and not isinstance(plain.TILE, tl.constexpr)
    with pytest.raises(KeyError, match="MODE"):
        node_groups(dict(OFF=1, DIM=2, TILE=3))


def test_launched_kernels_take_at_most_40_parameters():
    """Every kernel a buffer launches takes at most 40 parameters (issue 46: its constexprs in
    groups; the inter-node kernels take the node kernel's as one, ``NODE``)."""
    import inspect

    from moe_ep.internode.combine_kernels import internode_combine_kernel
    from moe_ep.internode.dispatch_kernels import internode_dispatch_kernel
    from moe_ep.kernels.combine import node_combine_kernel
    from moe_ep.kernels.dispatch import node_dispatch_kernel
    from moe_ep.kernels.recv_total import recv_total_kernel
    from moe_ep.kernels.route import route_hist_kernel
    counts = {k.fn.__name__: len(inspect.signature(k.fn).parameters) for k in (
        node_dispatch_kernel, node_combine_kernel, route_hist_kernel, recv_total_kernel, internode_dispatch_kernel,
        internode_combine_kernel)}
    assert max(counts.values()) <= 40, counts


def test_native_launch_hands_the_driver_the_packed_plan(tmp_path, monkeypatch):
    """A native plan's launch through a stand-in CUDA driver: cuLaunchKernel gets the plan's
    function, grid, block, shared memory and the stream, and parameter bytes equal to what
    ``packed`` says for the same values (checked against C's layout above); a bound launch the
    same with its fixed values; a launch failing in the driver raises RuntimeError with the
    driver's message; a wrong count of values or a non-int is refused before the plan's stage is
    touched (the next launch still passes the earlier values)."""
    import ctypes
    from stand_in_cuda import FakeLaunch, fake_cuda_lib

    lib = fake_cuda_lib(tmp_path)
    monkeypatch.setenv("MOE_EP_CUDA_LIB", lib)
    drv = ctypes.CDLL(lib)
    drv.fake_cuda_launches.restype = ctypes.c_long
    x, y = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)
    args = (x, y, 5, 1, 0.75, True)
    compiled = _fake_compiled(_SIG, num_warps=8, shared=4096)
    compiled.function = 0x5EED
    plan = L.NativePlan(compiled, 3, args, dict(BLOCK=16), (0, 2), _Fn.arg_names)
    drv.fake_cuda_expect_params(6)  # x, y, T, scale, flag and the two scratch pointers: the last at 6

    def last() -> FakeLaunch:
        got = FakeLaunch()
        drv.fake_cuda_last_launch(ctypes.byref(got))
        return got

    def check(launched, values, stream, bound=None):
        got = last()
        assert (got.function, got.stream, tuple(got.grid), tuple(got.block), got.shared) == \
            (0x5EED, stream, (3, 1, 1), (256, 1, 1), 4096)
        want = (bound or plan._all).packed(values)
        assert bytes(got.params[:len(want)]) == want

    n0 = drv.fake_cuda_launches()
    plan.launch((x, y, 9, 1, 0.75, True), stream=0xABC)
    assert drv.fake_cuda_launches() == n0 + 1
    check(plan, [x.data_ptr(), 9], 0xABC)
    bound = plan.bind((x, y, 77, 1, 0.75, True), [0])
    bound.launch(0xDEF, (x.data_ptr() + 64,))
    check(bound, [x.data_ptr() + 64], 0xDEF, bound)
    for bad, err in (((1, 2), ValueError), (["p"], TypeError), ({1}, TypeError)):
        with pytest.raises(err):
            bound.launch(0x123, bad)
    assert drv.fake_cuda_launches() == n0 + 2
    drv.fake_cuda_set_launch_result(700)
    try:
        with pytest.raises(RuntimeError, match="moe_ep native launch: cuLaunchKernel failed: .*illegal memory access"):
            bound.launch(0xDEF, [x.data_ptr()])
    finally:
        drv.fake_cuda_set_launch_result(0)
    bound.launch(0xDEF, [x.data_ptr() + 128])
    check(bound, [x.data_ptr() + 128], 0xDEF, bound)
    # a launch kept past its plan names no plan, not the next plan in its slot
    stale, old_id = bound.launch, bound.id
    plan._bound.clear()
    del bound
    fresh = LaunchPlan(0x5EED, 1, 32, 0, [8], [0], [0])
    assert fresh.id != old_id
    with pytest.raises(ValueError, match=f"plan_id {old_id} names no plan"):
        stale(0xDEF, [0])
    assert drv.fake_cuda_launches() == n0 + 4


def test_plan_choice(monkeypatch):
    """Native where it packs exactly what Triton passes; Triton's launcher for what it does not
    cover or when MOE_EP_LAUNCH=triton; kernel[grid] when a changing value was compiled in."""
    x, y = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)
    args, consts = (x, y, 5, 1, 0.75, True), dict(BLOCK=16)
    fn = _Fn()

    def plan(path="native", sig=_SIG, dyn=(0, 2), **meta):
        return type(L.make_plan(_fake_compiled(sig, **meta), fn, 1, args, consts, dyn, path)).__name__
    assert plan() == "NativePlan"
    assert plan("triton") == "TritonPlan"
    assert plan(global_scratch_size=128) == "TritonPlan"
    assert plan(profile_scratch_size=8) == "TritonPlan"
    assert plan(num_ctas=2) == "TritonPlan"
    assert plan(launch_cooperative_grid=True) == "TritonPlan"
    assert plan(launch_pdl=True) == "TritonPlan"
    assert plan(dyn=(0, 4)) == "TritonPlan"                    # a float that changes
    assert plan(sig={**_SIG, "T": "constexpr"}) == "JitPlan"   # T == 1 when compiled: Triton made it a constant
    monkeypatch.setattr(L, "NATIVE_TRITON", ((9, 9),))
    assert plan() == "TritonPlan"


def test_launch_path_setting(monkeypatch):
    monkeypatch.setenv("MOE_EP_LAUNCH", "cuda-graph")
    with pytest.raises(ValueError, match="MOE_EP_LAUNCH: expected one of native, triton"):
        L.Launcher(torch.device("cuda", 0))
    monkeypatch.setenv("MOE_EP_LAUNCH", "triton")
    assert L.Launcher(torch.device("cuda", 0)).path == "triton"
    monkeypatch.delenv("MOE_EP_LAUNCH")
    assert L.Launcher(torch.device("cuda", 0)).path == "native"


@pytest.mark.gpu
def test_native_launch_matches_tritons_launch_gpu():
    """The same kernel through Triton's launch and through a native plan (first call, replays with
    other pointers and values, a bound launch): the same results."""
    if dist_util.cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    x = torch.arange(64, dtype=torch.float32, device=dev)
    consts = dict(BLOCK=64, ADD=1.0)
    la = L.Launcher(dev)
    assert la.path == "native"
    outs = []
    for n in (3, 5, 7, -2):
        y_ref, y = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        _axpb[(1,)](x, y_ref, n, **consts)
        plan = la(("axpb",), _axpb, 1, (x, y, n), consts, (1, 2))
        outs.append((y_ref, y, n))
    assert type(plan).__name__ == "NativePlan"
    bound = plan.bind((x, y, 9), [1])
    y9 = torch.full_like(x, float("nan"))
    bound.launch(la.stream(), [y9.data_ptr()])
    torch.cuda.synchronize()
    for y_ref, y, n in outs:
        assert torch.equal(y, y_ref) and torch.equal(y, x * n + 1), n
    assert torch.equal(y9, x * 9 + 1)


@triton.jit
def _constexpr_first(BLOCK: tl.constexpr, a_ptr):
    pass


def test_runtime_args_by_name():
    """A launch's runtime arguments given by name come out in parameter order; a missing or unknown
    name, or a kernel whose constexprs come before its runtime parameters, is refused by name."""
    a, b = torch.zeros(2), torch.zeros(2, dtype=torch.int32)
    assert L.runtime_args(_k, n=5, b_ptr=b, a_ptr=a) == (a, b, 5)
    assert L.arg_positions(_k, "n", "a_ptr") == (2, 0)
    with pytest.raises(TypeError, match=r"_k: runtime arguments missing \['n'\], unknown \['m'\]"):
        L.runtime_args(_k, a_ptr=a, b_ptr=b, m=5)
    with pytest.raises(TypeError, match=r"_k: no runtime parameters \['BLOCK'\]"):
        L.arg_positions(_k, "BLOCK")
    with pytest.raises(TypeError, match="_constexpr_first: its runtime parameters must come before"):
        L.runtime_args(_constexpr_first, a_ptr=a)


def test_register_budget():
    """maxnreg specs: none, the register file over a program's threads, a count capped by it;
    anything else is refused naming the caller's variable."""
    assert L.register_budget("", 16) is None and L.compile_options(16) == {"num_warps": 16}
    assert L.register_budget("none", 32) is None and L.compile_options(32, "none") == {"num_warps": 32}
    assert L.register_budget("full", 16) == 128 and L.register_budget("full", 32) == 64
    assert L.register_budget("96", 16) == 96 and L.register_budget("96", 32) == 64
    assert L.compile_options(32, "full") == {"num_warps": 32, "maxnreg": 64}
    assert L.register_budget("full", 4) == 255  # (the most a thread can address)
    for bad in ("8", "256", "many", "-64", " 64"):
        with pytest.raises(ValueError, match=f"^MOE_EP_MAXNREG: expected 'none', 'full' or a register count .*got '{bad}'"):
            L.register_budget(bad, 16, "MOE_EP_MAXNREG")


def test_launch_graph_hands_the_driver_each_plans_values(tmp_path, monkeypatch):
    """A launch graph of two native plans through the stand-in driver: one cuGraphLaunch on the
    stream given, its nodes in order, each with its plan's function, grid and the parameter bytes
    ``packed`` gives for that launch's values (written into the nodes at the launch, so a later
    launch's values are the ones used); wrong values are refused before anything is written; a
    graph of no plans, or of a plan that cannot launch, is refused. Into a stream being captured
    (a caller's CUDA graph) the plans launch one by one, with this launch's values."""
    import ctypes
    from stand_in_cuda import FakeLaunch, fake_cuda_lib

    from moe_ep.native.launch import LaunchGraph
    from moe_ep.native.library import NativeError

    lib = fake_cuda_lib(tmp_path)
    monkeypatch.setenv("MOE_EP_CUDA_LIB", lib)
    drv = ctypes.CDLL(lib)
    drv.fake_cuda_launches.restype = drv.fake_cuda_graph_launches.restype = ctypes.c_long
    drv.fake_cuda_expect_params(3)
    a = LaunchPlan(0xA1, 4, 128, 0, [8, 4, 8], [11, 12, 13], [0, 1])
    b = LaunchPlan(0xB2, 6, 256, 512, [8, 4, 8], [21, 22, 23], [2])
    g = LaunchGraph([a, b])
    n0, g0 = drv.fake_cuda_launches(), drv.fake_cuda_graph_launches()

    def node(i) -> FakeLaunch:
        got = FakeLaunch()
        drv.fake_cuda_graph_node(i, ctypes.byref(got))
        return got

    for k, (va, vb) in enumerate((((100, 7), (300,)), ((101, 8), (301,)))):
        g.launch(0x5A, (va, vb))
        assert drv.fake_cuda_graph_launches() == g0 + 1 + k and drv.fake_cuda_launches() == n0 + 2 * (k + 1)
        for i, (plan, fn, grid, block, shared, vals) in enumerate(((a, 0xA1, 4, 128, 0, va), (b, 0xB2, 6, 256, 512, vb))):
            got = node(i)
            assert (got.function, got.stream, got.grid[0], got.block[0], got.shared) == (fn, 0x5A, grid, block, shared)
            want = plan.packed(vals)
            assert bytes(got.params[:len(want)]) == want
    for bad, err in ((((1, 2),), ValueError), (((1, 2), (3, 4)), ValueError), (((1, "x"), (3,)), TypeError)):
        with pytest.raises(err):
            g.launch(0x5A, bad)
    assert drv.fake_cuda_graph_launches() == g0 + 2
    drv.fake_cuda_set_capturing(1)
    try:
        n1 = drv.fake_cuda_launches()
        g.launch(0x6B, ((102, 9), (302,)))
        last = FakeLaunch()
        drv.fake_cuda_last_launch(ctypes.byref(last))
    finally:
        drv.fake_cuda_set_capturing(0)
    assert drv.fake_cuda_graph_launches() == g0 + 2 and drv.fake_cuda_launches() == n1 + 2
    assert (last.function, last.stream, last.grid[0]) == (0xB2, 0x6B, 6)
    assert bytes(last.params[:len(b.packed((302,)))]) == b.packed((302,))
    with pytest.raises(NativeError, match="launch graph: 0 plans"):
        LaunchGraph([])
    with pytest.raises(NativeError, match="not a launchable plan"):
        LaunchGraph([a, LaunchPlan(0, 1, 32, 0, [8], [0], [0])])
