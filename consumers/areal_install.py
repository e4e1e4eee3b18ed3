"""Importing this module runs AReaL's trainer on rollstream: ``import rollstream.consumers.areal_install`` in the
training script, above the trainer, is the whole change (`rollstream.consumers.areal.install`: AReaL's SPMD engines
then build a `rollstream.consumers.areal.RollstreamExecutor`). Settings come from ``ROLLSTREAM_*`` environment
variables (`rollstream.consumers.areal.ArealSettings.of`)."""

from rollstream.consumers.areal import install

install()
