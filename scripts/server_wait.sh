# shellcheck shell=bash
# Sourced by demo.sh and soak.sh (not run on its own).
# wait_for_port_file FILE PID LOG SECONDS: waits until mlaverify-server has
# written its --port-file, which it does once SERVING. Fails, printing the
# server's log, when the server exits first or SECONDS pass.
wait_for_port_file() {
  local file=$1 pid=$2 log=$3 seconds=$4 i
  for ((i = 0; i < seconds * 10; ++i)); do
    [ -s "$file" ] && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      cat "$log"
      echo "the server exited before serving" >&2
      return 1
    fi
    sleep 0.1
  done
  cat "$log"
  echo "the server was not serving after $seconds s" >&2
  return 1
}
