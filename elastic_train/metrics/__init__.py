"""What a node tells the outside about its run: Prometheus metrics served by each agent (docs/metrics.md).

- :mod:`elastic_train.metrics.agent`: the agent's metrics (``prometheus-client``), the HTTP endpoint on an
  opt-in port, and the counters other parts of the agent increment (fences, recoveries).

The rendezvous fills the run's view at scrape time (:mod:`elastic_train.rendezvous.observe`); the workers'
figures (steps/s, snapshot and durable write seconds) reach their agent through the node contract
(:class:`elastic_train.node.Stats`).
"""
