"""The lab: trains a target and both drafters from text on the machine, then measures them (README.md here)."""
