"""Appliance mode: a job service that shares a pool of systems among users (see service.py), and its client."""

from waferscale.appliance.client import ApplianceError, Client

__all__ = ["ApplianceError", "Client"]
