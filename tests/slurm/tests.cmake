# tests/slurm — the slurm/ sbatch scripts under a real Slurm (owner: plan/slurm): munged,
# slurmctld and slurmd from Debian's packages (installed when missing; root), a private config,
# each script submitted on the tiny model (cpu, 2 x 2), job states and outputs checked, a failing
# rank's job FAILED with the rank named; every daemon stopped by PID. ~15 s (+ apt on a fresh
# machine). k3 comes from K3_BIN (the build's), the scripts from K3_SRC.
add_test(NAME slurm_jobs COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/slurm_test.sh)
set_tests_properties(slurm_jobs PROPERTIES LABELS "mpi" TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
