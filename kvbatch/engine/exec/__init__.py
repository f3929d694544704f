"""Running a step: the model runner, launched steps, CUDA graphs and the sampler."""
