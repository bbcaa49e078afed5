"""Tensor parallelism on torch.distributed: one scheduler, N ranks running every step.

    engine process (rank 0, the driver)                 worker processes (ranks 1..N-1)
    -----------------------------------                 -------------------------------
    executor.py: hosts the rendezvous store (TCP,       worker.py: joins the store and the
      127.0.0.1, a port the OS picks), spawns the         groups, builds its ModelRunner (its
      workers (multiprocessing spawn), watches their      shard, its KV), then loops: receive a
      sentinels                                           step, run it, drop the results
    ModelRunner(rc, tp=executor.driver): its shard
    each step: step_message.send_step (broadcast of     step_message.receive_step -> the same
      the plan's arrays + sampling arrays, once) ->       ModelRunner.launch on the same plan
      the step on its own shard -> results (rank 0's)

groups.py sets up three process groups per rank: `setup` (gloo: setup agreements),
`control` (gloo, CPU tensors: the per-step message) and `device` (the models' all-reduce /
all-gather: gloo on CPU, NCCL on CUDA). rank.py is what a ModelRunner holds under TP (`TPRank`: its shard for the
loaders, the pool-size agreement, the step hook). models/parallel.py is the sharding itself.

At TP = 1 nothing here runs: no process, no group, no communication (engine.py starts an
executor only for tensor_parallel_size > 1, or for one torchrun-launched rank: the
distributed path on one device, what a one-GPU machine can check of it).
"""
