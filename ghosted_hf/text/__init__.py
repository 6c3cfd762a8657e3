"""Text in: one reader for every input a user has (`documents`) and one packer into token batches (`tokens`)."""
