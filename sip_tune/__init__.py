"""sip_tune: the SASS schedule tuner of rosekernels' kernels, on top of the engine (`sip`) and the
package (`rosekernels`).

* `sip_tune.runner`    - the GPU worker process: load, test and time candidate cubins, crash-isolated.
* `sip_tune.tuning`    - the tune loop (simulated annealing over engine schedules), the final
  validation and the report; the winner goes into the tuned store (`rosekernels.tuned`).
* `sip_tune.configs`   - level 1: a kernel's configurations searched for one shape, the winner
  tested at its bucket's edges.
* `sip_tune.oplevel`   - a tuned config or cubin re-timed through the public op in a fresh process,
  as a user loads it, before it is stored (and for benchmarks).
* `sip_tune.workloads` - what to run for a kernel of the package, from its kernel-module contract.
* `sip_tune.cli`       - the `sip-tune` command.
"""
