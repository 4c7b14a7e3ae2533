"""sip_tune: the tuner of rosekernels' kernels, on top of the engine (`sip`) and the package (`rosekernels`).

* `sip_tune.workloads` - what to run for a kernel of the package, from its kernel-module contract.
* `sip_tune.configs`   - level 1: search a kernel's configs for one shape (its candidates, pruned by its
  rank), test and time them on the GPU, the winner tested at its bucket's edges; it goes into the
  tuned store (`rosekernels.tuned`).
* `sip_tune.model`     - level 1 for every kernel and shape one forward pass of a model runs (`--model`).
* `sip_tune.tuning`    - level 2: the tune loop (simulated annealing over engine schedules), the final
  validation and the report; the winner goes into the tuned store.
* `sip_tune.oplevel`   - a tuned config or cubin re-timed through the public op in a fresh process,
  as a user loads it, before it is stored (and for benchmarks).
* `sip_tune.compute`   - the compute-bound kernels level 2 is aimed at, as tuner workloads.
* `sip_tune.runner`    - the GPU worker process: load, test and time candidate cubins, crash-isolated.
* `sip_tune.probe`     - a candidate run once more under compute-sanitizer or Nsight Compute.
* `sip_tune.cli`       - the `sip-tune` command.
"""
