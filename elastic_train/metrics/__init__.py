"""What a node tells the outside about its run: Prometheus metrics served by each agent (docs/metrics.md).

- :mod:`elastic_train.metrics.stats`: the one seam through which workers' figures (steps, snapshot and durable
  write seconds) reach their agent: a small stats file per worker process in the agent's directory. It
  imports nothing but the standard library (workers import it).
- :mod:`elastic_train.metrics.agent`: the agent's metrics (``prometheus-client``), the HTTP endpoint on an
  opt-in port, and the counters other parts of the agent increment (fences, evictions, recoveries).

The rendezvous fills the run's view at scrape time (:mod:`elastic_train.rendezvous.observe`).
"""
