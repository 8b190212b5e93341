"""The reward tier: scores trajectories and publishes them to the scored stream.

Components:

* ``config``: ``RewardConfig`` with its scorer union (function | http | model), torch-free;
* ``scorers``: the ``Scorer`` protocol and one module per kind;
* ``combine``: pure weighting of several scorers' outputs;
* ``batcher``: async micro-batching of concurrent requests into one scorer call;
* ``service``: ``RewardService.handle(Trajectory) -> [Output(scored, ScoredTrajectory)]`` for the
  shared consumer loop;
* ``serve_rm``: ``streamrl serve-rm``, an HTTP server for a local reward model (same JSON protocol).
"""
