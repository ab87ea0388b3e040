"""Tensor parallelism: process groups, collectives, sharding of a built model."""
