"""EPGroup's default node size: ranks sharing a host, and on GPU only when every pair of their
GPUs can access each other peer to peer (the P2P query is injected as a matrix on CPU)."""
import os

import pytest

import dist_util
from moe_ep.core.group import p2p_node_size

T, F = True, False


def test_p2p_node_size_all_reachable():
    full = [[T] * 4 for _ in range(4)]
    assert p2p_node_size(4, full) == (4, None)
    assert p2p_node_size(2, full) == (2, None)


def test_p2p_node_size_one_pair_missing():
    m = [[T] * 4 for _ in range(4)]
    m[3][1] = F  # one direction is enough to fall back
    n, msg = p2p_node_size(4, m)
    assert n == 1 and "ranks 1 and 3" in msg and "node_size=1" in msg and "\n" not in msg
    # two nodes of 2: ranks 1 and 3 are on different nodes, their entry is not looked at
    assert p2p_node_size(2, m) == (2, None)
    m[2][3] = F
    n, msg = p2p_node_size(2, m)
    assert n == 1 and "ranks 2 and 3" in msg
    # entries across nodes may be unknown (None)
    assert p2p_node_size(2, [[T, T, None, None], [T, T, None, None], [None, None, T, T], [None, None, T, T]]) == (2, None)


def _cpu_worker(rank, R, env, arg):
    import moe_ep

    old = os.environ.pop("MOE_EP_NODE_SIZE", None)
    try:
        if env:
            os.environ["MOE_EP_NODE_SIZE"] = env
        return moe_ep.EPGroup(node_size=arg).node_size
    finally:
        os.environ.pop("MOE_EP_NODE_SIZE", None)
        if old is not None:
            os.environ["MOE_EP_NODE_SIZE"] = old


def test_cpu_default_env_and_argument():
    assert dist_util.run(2, _cpu_worker, None, None) == [2, 2]  # one host, no P2P query on CPU
    assert dist_util.run(2, _cpu_worker, "1", None) == [1, 1]   # MOE_EP_NODE_SIZE
    assert dist_util.run(2, _cpu_worker, "1", 2) == [2, 2]      # the argument wins


def _fake_gpu_worker(rank, R, blocked):
    """The GPU code path of the default over gloo: device index = rank, the P2P query patched so
    that only the (src, dst) pairs in ``blocked`` fail (each rank asks only about its own row)."""
    import types
    import warnings

    import torch

    import moe_ep

    os.environ.pop("MOE_EP_NODE_SIZE", None)
    g = moe_ep.EPGroup()
    g.device = types.SimpleNamespace(type="cuda", index=rank)
    asked = []
    real = torch.cuda.can_device_access_peer
    torch.cuda.can_device_access_peer = lambda a, b: asked.append((a, b)) or [a, b] not in blocked
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            n = g._node_size(None)
    finally:
        torch.cuda.can_device_access_peer = real
    return n, [str(x.message) for x in w], asked


def test_gpu_default_logic_over_gloo():
    out = dist_util.run(2, _fake_gpu_worker, [])
    assert [o[:2] for o in out] == [(2, []), (2, [])]
    assert [o[2] for o in out] == [[(0, 1)], [(1, 0)]]
    out = dist_util.run(2, _fake_gpu_worker, [[1, 0]])  # rank 1 cannot reach rank 0: both fall back
    for n, msgs, _ in out:
        assert n == 1 and len(msgs) == 1 and "ranks 0 and 1" in msgs[0]


def _gpu_worker(rank, R):
    import warnings

    import moe_ep

    os.environ.pop("MOE_EP_NODE_SIZE", None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        n = moe_ep.EPGroup().node_size
    forced = moe_ep.EPGroup(node_size=R).node_size
    return n, [str(x.message) for x in w if "peer to peer" in str(x.message)], forced


@pytest.mark.gpu
def test_gpu_default_node_size_needs_p2p():
    import torch

    n = dist_util.cuda_device_count()
    if n < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {n}")
    p2p = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    for node_size, msgs, forced in dist_util.run(2, _gpu_worker, backend="nccl"):
        assert forced == 2
        if p2p:
            assert (node_size, msgs) == (2, [])
        else:
            assert node_size == 1 and len(msgs) == 1 and "ranks 0 and 1" in msgs[0]


def test_device_argument():
    """``device=`` overrides the backend's default; anything but cuda or cpu is refused by name."""
    import torch

    import moe_ep

    assert moe_ep.EPGroup(device="cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="device"):
        moe_ep.EPGroup(device="meta")


def _node_group_worker(rank, world_size):
    import torch.distributed as dist

    import moe_ep

    g = moe_ep.EPGroup(node_size=2)
    sub = g.node_group()
    assert g.node_group() is sub  # made once
    peers = [None] * dist.get_world_size(sub)
    dist.all_gather_object(peers, rank, group=sub)
    return peers


def test_node_group_holds_the_node():
    """``node_group()`` of 2 nodes x 2: each rank's group is its own node's two ranks."""
    assert dist_util.run(4, _node_group_worker) == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_env_device():
    """MOE_EP_DEVICE's values: cpu and cuda[:N] as torch reads them; cuda without a GPU and other
    devices are refused by name."""
    import torch

    from moe_ep.core.group import env_device

    assert env_device("cpu", "MOE_EP_DEVICE") == torch.device("cpu")
    for bad in ("meta", "tpu", "cuda:x"):
        with pytest.raises(ValueError, match="MOE_EP_DEVICE"):
            env_device(bad, "MOE_EP_DEVICE")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            env_device("cuda", "MOE_EP_DEVICE")


def _memory_choice_worker(rank, R, node_size, forced):
    import moe_ep
    from moe_ep.core.node_memory import select_node_memory

    os.environ.pop("MOE_EP_NODE_MEMORY", None)
    if forced is not None:
        os.environ["MOE_EP_NODE_MEMORY"] = forced
    try:
        g = moe_ep.EPGroup(node_size=node_size)
        return select_node_memory(g)[0], g.ranks_per_device, g.node_shares_device()
    except ValueError as exc:
        return str(exc)
    finally:
        os.environ.pop("MOE_EP_NODE_MEMORY", None)


def test_node_memory_selection_on_cpu():
    """CPU ranks use shared-memory segments whatever MOE_EP_NODE_MEMORY asks (no GPU memory to map),
    and share no device."""
    assert dist_util.run(2, _memory_choice_worker, 2, None) == [("shm", 1, False)] * 2
    assert dist_util.run(2, _memory_choice_worker, 1, "ipc") == [("shm", 1, False)] * 2
