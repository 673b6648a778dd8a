"""Videos: decoding on a player's clock, the frame budget, stored frames, timelines and cuts."""
