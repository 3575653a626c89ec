"""Model building blocks shared by the target and the drafter, one op family per module."""
