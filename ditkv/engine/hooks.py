"""Rank hooks: the extension point for changing how the ranks of a replica run, without a new executor.

An executor's options may carry `hooks`, a `RankHooks` (None: the defaults below). The executors
read it through `rank_hooks(options)`; the same object travels to every spawned rank process with
the options, so a subclass must pickle by reference (define it at module level). The AR stage server
(`stages/ar_server.py`) takes one as a constructor argument for its in-process replicas.

Points, each a method whose default is what the engine does without hooks:
- `num_ranks(config)`: how many rank processes the replica runs (`config.world_size`);
- `init_group(config, rank, world_size, init_method, options)`: a rank's process group and its
  `ParallelContext` (`worker.parallel.init_parallel`); called only when there are several ranks;
- `at_step_boundary(rank, request_id, step)`: on every rank, before each step, for every running
  request (`step`: the request's step index); raising fails that request on that rank, as any
  rank-local error does (the ranks vote, so the peers stop it at the same boundary). Only a
  subclass that defines it pays for that vote;
- `on_transport(transport, rank, role)`: each KV transport a rank's KV service (consumer or
  `rank_service`) or an AR stage server's replica opens, once, before its first transfer; `role` is
  the transfer's `kv_role`.

The tests' hooks (`tests/rank_hooks.py`) use these to run replicated ranks without sharding, to
inject a fault on one rank and to hold KV writes.
"""

from __future__ import annotations


class RankHooks:
    def num_ranks(self, config) -> int:
        return config.world_size

    def init_group(self, config, rank: int, world_size: int, init_method: str, options):
        from ..worker.parallel import init_parallel

        return init_parallel(config, rank, world_size, init_method, timeout_s=options.collective_timeout_s,
                             devices=getattr(options, "devices", None))

    def at_step_boundary(self, rank: int, request_id: str, step: int) -> None:
        pass

    def on_transport(self, transport, rank: int, role: str | None) -> None:
        pass


_DEFAULT = RankHooks()


def rank_hooks(options) -> RankHooks:
    """The hooks `options` carries (its `hooks` attribute), else the defaults."""
    hooks = getattr(options, "hooks", None)
    return _DEFAULT if hooks is None else hooks
