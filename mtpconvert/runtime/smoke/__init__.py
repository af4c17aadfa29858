"""What gates a conversion: the decoding smoke, the layerwise (and streamed) teacher-forced check, the MLP gain."""
