"""Checks run on hardware this machine may lack: the generation engine on an NVIDIA GPU."""
