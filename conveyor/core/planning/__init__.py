"""The meta scheduler's pure decisions: the plan over connectors, brokers and runs, the partition-task planner and the state transitions they carry."""
