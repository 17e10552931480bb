"""One training run from the params (fit.run.Run): what it builds before its loop (setup), what it
resumes from (resume), the rate `train.lr: auto` finds (lr_auto). Between the stages and the model
side: it reads the params models (`train.*`), which the model side never sees, and calls the model
side with values; never the stages, the flows or Prefect."""
