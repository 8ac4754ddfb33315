"""This host's facts: Conveyor's home, ports and processes."""
