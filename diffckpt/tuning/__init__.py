"""The auto-tuner.

- :mod:`.model`: the cost model and the pure policy that picks settings from measurements;
- :mod:`.meter`: online measurements, fed by the engine and the writer;
- :mod:`.online`: the settings in force during training, the reviews and their log;
- :mod:`.risk`: what the chosen settings risk per failure, in the log and ``diffckpt ls``;
- :mod:`.probe`: timed writes to a storage location and the write-cost fit;
- :mod:`.planner`: ``diffckpt tune``'s recommendation before training, from the size model
  (:mod:`.sizing`) and microbenchmarks of this machine (:mod:`.host`).
"""
