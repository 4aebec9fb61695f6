"""Faults from outside the process: preemption signals, two runs on one folder, too little
memory. Each module turns one of them into a defined outcome (a checkpoint and an exit code,
a refusal naming the holder, a refusal naming the bytes) instead of a kill mid-step.
"""
