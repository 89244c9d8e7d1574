"""The auto-tuner: the cost model and its pure policy (:mod:`.model`), online measurements
(:mod:`.meter`), the settings in force during training (:mod:`.online`) and ``diffckpt tune``
(:mod:`.advice`)."""
