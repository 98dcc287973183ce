"""The drafter's math and its checkpoints, shared by serving and training."""
