"""What plugs into torchtitan: the run, our Trainer, the TrainSpecs and what they build."""
