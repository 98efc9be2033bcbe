#!/bin/sh
# Container entry point for every vime image: load the shared bearer token from a file (a compose
# secret or a mounted Kubernetes Secret) into VIME_API_TOKEN, which is where the services read it,
# then run the command. A token file that is named but cannot be read is a start-up error, so a
# service never comes up unauthenticated by accident.
set -eu
if [ -z "${VIME_API_TOKEN:-}" ]; then
  file="${VIME_API_TOKEN_FILE:-/run/secrets/vime_api_token}"
  if [ -r "$file" ]; then
    VIME_API_TOKEN="$(tr -d '\r\n' < "$file")"
    export VIME_API_TOKEN
  elif [ -n "${VIME_API_TOKEN_FILE:-}" ]; then
    echo "vime: VIME_API_TOKEN_FILE=$VIME_API_TOKEN_FILE is not readable" >&2
    exit 64
  fi
  if [ -n "${VIME_API_TOKEN_FILE:-}" ] && [ -z "${VIME_API_TOKEN:-}" ]; then
    echo "vime: the token file $VIME_API_TOKEN_FILE is empty" >&2
    exit 64
  fi
fi
exec "$@"
