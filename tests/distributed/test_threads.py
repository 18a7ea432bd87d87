"""Per-rank host-thread budget (Note [Rank thread budget]): pure logic, no processes."""

from __future__ import annotations

import pytest

from annotate_offload.distributed import local_thread_budget
from annotate_offload.distributed._threads import numa_nodes, parse_cpulist
from annotate_offload.optim import HybridDeviceOptimizer

TWO_NODES = {0: list(range(0, 16)), 1: list(range(16, 32))}  # the 2-GPU machine: 32 cores


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]
    with pytest.raises(ValueError, match="'x-2'"):
        parse_cpulist("x-2")
    with pytest.raises(ValueError, match="decreasing"):
        parse_cpulist("4-2")


def test_two_ranks_on_two_numa_nodes_get_one_node_each():
    b = [local_thread_budget(r, 2, cpus=list(range(32)), nodes=TWO_NODES) for r in range(2)]
    assert [x.numa_node for x in b] == [0, 1]
    assert b[0].cpus == tuple(range(16)) and b[1].cpus == tuple(range(16, 32))
    assert [x.threads for x in b] == [15, 15]  # one core per rank left to the thread launching GPU work


def test_four_ranks_split_each_node_and_cover_every_core_once():
    b = [local_thread_budget(r, 4, cpus=list(range(32)), nodes=TWO_NODES) for r in range(4)]
    assert [x.numa_node for x in b] == [0, 0, 1, 1]
    assert sorted(c for x in b for c in x.cpus) == list(range(32))
    assert {x.threads for x in b} == {7}


def test_affinity_restricts_nodes_and_uneven_split_goes_to_low_ranks():
    # taskset -c 0-4,16-20: five usable cores per node
    cpus = [*range(0, 5), *range(16, 21)]
    b = [local_thread_budget(r, 2, cpus=cpus, nodes=TWO_NODES) for r in range(2)]
    assert b[0].cpus == (0, 1, 2, 3, 4) and b[1].cpus == (16, 17, 18, 19, 20)
    one = [local_thread_budget(r, 3, cpus=list(range(7)), nodes={}) for r in range(3)]
    assert [len(x.cpus) for x in one] == [3, 2, 2]
    assert [x.numa_node for x in one] == [-1, -1, -1]


def test_one_process_gets_every_node():
    b = local_thread_budget(0, 1, cpus=list(range(32)), nodes=TWO_NODES)
    assert b.cpus == tuple(range(32)) and b.threads == 31 and b.numa_node == -1


def test_more_ranks_than_cores_still_one_thread_each():
    b = [local_thread_budget(r, 8, cpus=[0, 1], nodes={}) for r in range(8)]
    assert {x.threads for x in b} == {1}


def test_torchrun_environment_and_omp_num_threads_ignored(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun sets with several processes per node
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    b = local_thread_budget(cpus=list(range(32)), nodes=TWO_NODES)
    assert (b.local_rank, b.local_world_size, b.threads, b.numa_node) == (1, 2, 15, 1)
    # the optimizer takes it as given, whatever OMP_NUM_THREADS says (on the 32-core host it is for)
    import torch

    monkeypatch.setattr("annotate_offload.optim._hybrid.usable_cpus", lambda: 32)
    opt = HybridDeviceOptimizer([torch.nn.Parameter(torch.ones(4))], offload_fraction=1.0, cpu_threads=b.threads)
    assert opt.thread_budget == 15
    opt.close()


def test_this_machine_reads_sys():
    nodes = numa_nodes()
    b = local_thread_budget(0, 1)
    assert b.threads >= 1 and b.cpus
    if nodes:
        assert b.numa_node in nodes


def test_validation(monkeypatch):
    with pytest.raises(ValueError, match="local_rank=2"):
        local_thread_budget(2, 2)
    with pytest.raises(ValueError, match="local_world_size must be >= 1"):
        local_thread_budget(0, 0)
    with pytest.raises(TypeError, match="local_rank must be an int"):
        local_thread_budget(0.5, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two'"):
        local_thread_budget()
    with pytest.raises(ValueError, match="no usable CPU"):
        local_thread_budget(0, 1, cpus=[])


def test_ranks_follow_their_gpus_numa_node():
    # GPU 0 on node 1, GPU 1 on node 0: each rank gets the cores next to its own GPU
    b = [local_thread_budget(r, 2, cpus=list(range(32)), nodes=TWO_NODES, rank_nodes=[1, 0]) for r in range(2)]
    assert [x.numa_node for x in b] == [1, 0]
    assert b[0].cpus == tuple(range(16, 32))
    # both GPUs on node 0: both ranks share node 0 (8 cores each), node 1 is left alone
    b = [local_thread_budget(r, 2, cpus=list(range(32)), nodes=TWO_NODES, rank_nodes=[0, 0]) for r in range(2)]
    assert [x.cpus for x in b] == [tuple(range(8)), tuple(range(8, 16))]
    # torchrun --numa-binding=node: this rank's affinity is its node (the other one is not usable here);
    # it still gets the whole of its own node
    b1 = local_thread_budget(1, 2, cpus=list(range(16, 32)), nodes=TWO_NODES, rank_nodes=[0, 1])
    assert b1.cpus == tuple(range(16, 32)) and b1.threads == 15
    with pytest.raises(ValueError, match="rank_nodes has 1 entries"):
        local_thread_budget(0, 2, cpus=list(range(32)), nodes=TWO_NODES, rank_nodes=[0])


def test_no_cuda_means_no_gpu_nodes():
    from annotate_offload.distributed._threads import gpu_numa_nodes
    import torch

    if not torch.cuda.is_available():
        assert gpu_numa_nodes(2) is None
