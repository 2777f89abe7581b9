"""Tooling on top of the engine: the `ftl` CLI, the launcher, chaos runs and `ftl status`."""
