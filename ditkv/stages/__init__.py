"""Stage machinery: orchestrator, AR and DiT replicas, AR server and remote proxies, placement,
stage-graph config. Above the engine; the transfer library (tickets, descriptors, transports,
connectors) sits below it."""
