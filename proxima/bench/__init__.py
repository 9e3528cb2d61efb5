"""`proxima bench`: load generator and side-by-side report, stock vLLM vs Proxima.

Two modes share one request list (``proxima.workloads``) and one report:

* online (``online.py``): streams requests to OpenAI-compatible servers over HTTP and
  measures what a client sees (TTFT, inter-token latency, end-to-end latency, throughput),
  plus the server's preemption counter from its Prometheus ``/metrics``;
* offline (``offline.py``): builds vLLM's ``LLM`` in this process, once with the stock
  block pool and once with Proxima, and measures throughput, preemptions, KV blocks,
  contiguity and token identity.

``stats.py`` holds the arithmetic (percentiles, medians, ratios), ``report.py`` the
terminal table, JSON and PNG, ``cli.py`` the arguments. Nothing here changes what the
engine does; bench only reads.
"""
