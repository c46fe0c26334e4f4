"""The merge, as data and a check: recipe -> mergekit configuration (`config`), and the exactness
check of a merged checkpoint (`check`). The stage that runs mergekit is `trtbuild.merge_stage`."""
