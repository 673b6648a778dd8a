"""Videos: decoding on a player's clock, stored frames, timelines and cuts."""
