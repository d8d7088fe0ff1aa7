# The paper's data files as the authors published them (github.com/ltjed/multiagent-coaching at ed66921, folder
# data/Bench/), with their SHA-256. Sourced by train_mappa_mathchat.sh and train_mappa_dsbench.sh, which call
# `paper_data DIR FILE...` before `ray job submit`: a missing or different file stops the launch, saying where it
# comes from (README, Data; docs/reference.md, "The paper's data"). MAPPA_SKIP_DATA_CHECK=1 skips the check (the
# tests render the scripts' flags without the data).

paper_sha256() {
  case $1 in
    AIME_1983_2024.json) echo bf08c2a301e4f5dc338453c1e19d0993448452a0d5fdb739826cf609255671d3 ;;
    aime_2025.json) echo ad3c0c8341eedc8f3b7d4048a66ded19aca59403f373fb69aa153e95c719682b ;;
    amc_eval_32.json) echo ba208c17af3586190f6fb54695f3ce5627cdbd535af0038789f42d6aeedf6c0a ;;
    dsbench_modeling_train.json) echo 4b65338d578f6e3aeaba398264f1b755ff112df8143b36c7bf7bd40d03d5be4e ;;
    dsbench_modeling_eval.json) echo 6ea24184d84f2f6265c486058f1b94e13e920f15a5e2d9ef052c92d8b39e5b36 ;;
    dsbench_modeling_cleaned_prompts.json) echo fa5de59bab19296a1e4eed3305a594daa60bc3f199a8462653a3c4b6fbc44fdc ;;
  esac
}

paper_data() {  # DIR FILE...
  local dir=$1 file want got
  shift
  [ "${MAPPA_SKIP_DATA_CHECK:-0}" = 1 ] && return 0
  for file in "$@"; do
    want=$(paper_sha256 "$file")
    if [ ! -f "$dir/$file" ]; then
      echo "[mappa] $dir/$file is missing. It is the authors' data/Bench/$file (github.com/ltjed/multiagent-coaching," \
           "SHA-256 $want): put it in $dir, or set MAPPA_DATA to the directory holding it (README, Data)" >&2
      exit 1
    fi
    got=$( (sha256sum "$dir/$file" 2>/dev/null || shasum -a 256 "$dir/$file") | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
      echo "[mappa] $dir/$file has SHA-256 $got, not the authors' $want: it is not their data/Bench/$file" \
           "(github.com/ltjed/multiagent-coaching); fetch theirs, or give your own data with MAPPA_TRAIN_DATA /" \
           "MAPPA_EVAL_DATA (README, Data)" >&2
      exit 1
    fi
  done
}

imported() {  # TASKS METADATA: DSBench tasks imported from the authors' metadata file (checked first, in DIR)
  local tasks=$1 metadata=$2
  [ "${MAPPA_SKIP_DATA_CHECK:-0}" = 1 ] && return 0
  paper_data "$(dirname "$metadata")" "$(basename "$metadata")"
  if [ ! -f "$tasks" ]; then
    echo "[mappa] $tasks is missing: import the tasks of the authors' $(basename "$metadata") from DSBench's data," \
         "mappa dsbench import --data-root DIR --metadata $metadata --out $(dirname "$tasks") (README, DSBench)," \
         "with the authors' data/Bench/dsbench_modeling_cleaned_prompts.json (the agents' task text, SHA-256" \
         "$(paper_sha256 dsbench_modeling_cleaned_prompts.json)) beside the metadata" >&2
    exit 1
  fi
}
