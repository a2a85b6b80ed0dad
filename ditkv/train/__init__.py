"""Training of the tiny default model (`ditkv train-tiny`) and its quality check."""
