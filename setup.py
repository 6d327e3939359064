"""Packaging for mpi_kvstore: the metadata is in pyproject.toml; this shim keeps
``python setup.py ...`` and older tools working."""
from setuptools import setup

setup()
