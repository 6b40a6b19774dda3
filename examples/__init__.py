"""Example handler modules shipped with the worker."""
