"""Recipe -> mergekit configuration -> merged HF checkpoint, checked tensor by tensor."""
