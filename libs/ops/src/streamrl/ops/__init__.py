"""streamrl.ops: operator tooling - what runs, scales and inspects a streamrl job; no service imports it.

* the ``streamrl`` command (:mod:`.cli`): each package registers its subcommands as entry points;
* ``streamrl up`` (:mod:`.launcher`): an embedded redis-server (:mod:`.redis_server`) sized by the
  run's memory bound (:mod:`.memory_budget`), every service's replicas on a backend
  (:mod:`.replicas`: :mod:`.local_backend` child processes or :mod:`.ray_backend` Ray actors), the
  launch recipe's ``[up]`` table (:mod:`.up_config`);
* scaling: replica counts in Redis (:mod:`.scaling`), ``streamrl scale`` (:mod:`.scale_cli`), the
  backlog autoscaler (:mod:`.autoscale`);
* ``streamrl trace`` (:mod:`.trace_cli`, :mod:`.trace_report`): per-sample timelines from trace files;
* the Redis ACL file of a run (:mod:`.redis_acl`, ``python -m streamrl.ops.redis_acl``).

It sits on top of ``streamrl.common`` (which never imports it) and starts services as processes, never
importing them.
"""

__version__ = "0.1.0"
