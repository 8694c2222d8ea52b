"""Discrete-event simulation of a schedule on a cluster: times, bubbles, memory, communication."""
