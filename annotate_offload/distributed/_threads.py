"""Host-thread budget of one local rank, NUMA-aware where ``/sys`` tells (private).

Note [Rank thread budget]: ranks on one host share its cores and memory bandwidth, so each rank's
host step gets its own share of the cores, on its GPU's NUMA node where known. ``OMP_NUM_THREADS``
is ignored (torchrun sets it to 1 for several ranks per node).

    cpus     = this process's affinity (``os.sched_getaffinity``)
    nodes    = NUMA nodes from /sys/devices/system/node, restricted to ``cpus`` (empty ones dropped;
               no /sys -> one node holding ``cpus``)
    node(r)  = the node of rank r's GPU (``cuda:r``) when known and usable, shared with the ranks
               whose GPUs sit there; else contiguous blocks of ranks per node, or whole nodes when
               there are at least as many nodes as local ranks
    share(r) = the CPUs of node(r) dealt out among that node's local ranks, in rank order
    threads  = max(1, len(share(r)) - (1 if len(share(r)) >= 4 else 0))

One core of a share of four or more is left to the thread that launches GPU work (Note [Thread
budget] in ``optim/_hybrid.py``). Nothing is bound unless asked (:func:`bind_to_budget`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

__all__: list[str] = []

_NODE_ROOT = "/sys/devices/system/node"


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format).

    Raises:
        ValueError: a malformed list.
    """
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"parse_cpulist: cannot read {part!r} in cpulist {text!r}; expected e.g. '0-3,8'.") from None
        if b < a:
            raise ValueError(f"parse_cpulist: range {part!r} in cpulist {text!r} is decreasing.")
        out.extend(range(a, b + 1))
    return out


def numa_nodes(root: str = _NODE_ROOT) -> dict[int, list[int]]:
    """``{node id: CPU ids}`` as the kernel reports them (empty when /sys says nothing)."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    ids = sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())
    nodes: dict[int, list[int]] = {}
    for i in ids:
        try:
            with open(os.path.join(root, f"node{i}", "cpulist")) as f:
                nodes[i] = parse_cpulist(f.read())
        except (OSError, ValueError):
            continue
    return nodes


def gpu_numa_nodes(count: int) -> Optional[list[int]]:
    """NUMA node of ``cuda:0 .. cuda:count-1`` from /sys/bus/pci (``None`` when CUDA or /sys does not tell).

    Reads the device's PCI address from ``torch.cuda.get_device_properties`` (initialises CUDA, never
    at import) and ``/sys/bus/pci/devices/<address>/numa_node`` (``-1``, one node, counts as 0).
    """
    import torch

    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() < count:
            return None
        out = []
        for i in range(count):
            prop = torch.cuda.get_device_properties(i)
            addr = f"{prop.pci_domain_id:04x}:{prop.pci_bus_id:02x}:{prop.pci_device_id:02x}.0"
            with open(f"/sys/bus/pci/devices/{addr}/numa_node") as f:
                out.append(max(0, int(f.read().strip())))
        return out
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"local_thread_budget: environment variable {name}={raw!r} is not an integer; unset it or fix the launcher.") from None


@dataclass(frozen=True)
class ThreadBudget:
    """CPU threads and cores for one local rank's host work.

    Attributes:
        threads (int): threads for the host optimizer step (``HybridDeviceOptimizer(cpu_threads=...)``).
        cpus (tuple[int, ...]): the CPU ids this rank's share consists of.
        numa_node (int): the NUMA node of the share (``-1``: unknown, or the share spans several nodes).
        local_rank (int): the rank this budget is for.
        local_world_size (int): processes on this host.
    """

    threads: int
    cpus: tuple
    numa_node: int
    local_rank: int
    local_world_size: int


def local_thread_budget(
    local_rank: Optional[int] = None,
    local_world_size: Optional[int] = None,
    *,
    cpus: Optional[list[int]] = None,
    nodes: Optional["dict[int, list[int]] | list[list[int]]"] = None,
    rank_nodes: Optional[list[int]] = None,
) -> ThreadBudget:
    """The host-thread budget of one local rank (Note [Rank thread budget] in this module).

    Args:
        local_rank (int | None): this process's rank on the host. Default: ``LOCAL_RANK``, else 0.
        local_world_size (int | None): processes on the host. Default: ``LOCAL_WORLD_SIZE``, else 1.
        cpus (list[int] | None): usable CPU ids. Default: ``os.sched_getaffinity(0)``.
        nodes (dict[int, list[int]] | list[list[int]] | None): CPU ids per NUMA node (a list is
            indexed by node id; empty: no NUMA information). Default: read from /sys.
        rank_nodes (list[int] | None): NUMA node of each local rank's GPU. Default: read from /sys
            when this process sees ``local_world_size`` GPUs (rank ``r`` drives ``cuda:r``).

    Returns:
        ThreadBudget: ``threads`` for ``HybridDeviceOptimizer(cpu_threads=...)``, the CPU share and
        its NUMA node.

    Raises:
        TypeError: ``local_rank`` or ``local_world_size`` not an int.
        ValueError: ``local_world_size < 1``, ``local_rank`` outside ``[0, local_world_size)``, a
            non-integer ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, or no usable CPU.
    """
    lws = _env_int("LOCAL_WORLD_SIZE", 1) if local_world_size is None else local_world_size
    lr = _env_int("LOCAL_RANK", 0) if local_rank is None else local_rank
    for name, v in (("local_rank", lr), ("local_world_size", lws)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"local_thread_budget: {name} must be an int, got {v!r}.")
    if lws < 1:
        raise ValueError(f"local_thread_budget: local_world_size must be >= 1, got {lws}; it counts the processes on this host.")
    if not 0 <= lr < lws:
        raise ValueError(
            f"local_thread_budget: local_rank={lr} is outside [0, local_world_size={lws}); pass the rank on this host "
            "(torchrun's LOCAL_RANK), not the global rank."
        )
    usable = sorted(set(_affinity() if cpus is None else cpus))
    if not usable:
        raise ValueError("local_thread_budget: no usable CPU (empty affinity / cpus=[]); check taskset/cgroup settings.")
    raw = numa_nodes() if nodes is None else nodes
    items = sorted(raw.items()) if isinstance(raw, dict) else list(enumerate(raw))
    allowed = set(usable)
    pairs = [(i, sorted(allowed.intersection(c))) for i, c in items]
    pairs = [(i, c) for i, c in pairs if c]
    if not pairs:
        pairs = [(-1, usable)]  # no topology: the affinity is one node
    else:
        missing = allowed.difference(*(c for _, c in pairs))
        if missing:  # CPUs /sys does not place: count them with the first node
            pairs[0] = (pairs[0][0], sorted(set(pairs[0][1]) | missing))
    node_ids = [i for i, _ in pairs]
    node_cpus = [c for _, c in pairs]
    k = len(node_cpus)
    rn = (gpu_numa_nodes(lws) if lws > 1 else None) if rank_nodes is None else list(rank_nodes)
    if rn is not None and len(rn) != lws:
        raise ValueError(
            f"local_thread_budget: rank_nodes has {len(rn)} entries for local_world_size={lws}; give one NUMA node id per "
            "local rank (the node of the GPU that rank drives)."
        )
    if rn is not None and rn[lr] in node_ids:
        # this rank on its GPU's node, sharing it with the ranks whose GPUs sit there too (other
        # nodes may be outside this process's affinity, e.g. under torchrun --numa-binding=node)
        mine = [node_ids.index(rn[lr])]
        peers = [r for r in range(lws) if rn[r] == rn[lr]]
    elif k >= lws:
        mine = list(range(lr * k // lws, (lr + 1) * k // lws))  # whole nodes; one rank alone gets all
        peers = [lr]
    else:
        first = lr * k // lws  # contiguous blocks of ranks per node
        mine = [first]
        peers = [r for r in range(lws) if r * k // lws == first]
    pos = peers.index(lr)
    pool = sorted(c for i in mine for c in node_cpus[i])
    if len(peers) > len(pool):
        share = [pool[pos % len(pool)]]  # more ranks than cores: ranks share cores
    else:
        base, extra = divmod(len(pool), len(peers))
        start = pos * base + min(pos, extra)
        share = pool[start : start + base + (1 if pos < extra else 0)]
    n = len(share)
    threads = max(1, n - 1 if n >= 4 else n)
    return ThreadBudget(threads=threads, cpus=tuple(share), numa_node=node_ids[mine[0]] if len(mine) == 1 else -1, local_rank=lr, local_world_size=lws)


def bind_to_budget(budget: ThreadBudget) -> None:
    """Restrict this process to ``budget.cpus`` (``os.sched_setaffinity``); call before creating the optimizer.

    Raises:
        OSError: the kernel refused the affinity (CPU ids outside the cgroup).
    """
    os.sched_setaffinity(0, budget.cpus)
