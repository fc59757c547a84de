"""The CUDA transfer executor: batches made on the CPU, copied to the device and cast there."""
