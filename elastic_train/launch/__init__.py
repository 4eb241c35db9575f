"""Launching: the torchrun command line for one node (`run`) and a whole job on one machine (`local`)."""

from __future__ import annotations
