"""Correctness checks that need hardware this machine may lack (the generation engine on a GPU)."""
