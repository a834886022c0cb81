/* test_run_prompts.c — k3_run_parse_prompts: "1,2,3;4,5" into ids + lengths, with errors
 * naming the prompt and the bad id (pure; no MPI). */
#include "k3_run.h"
#include "k3_test.h"

int main(void) {
    int32_t *ids;
    int64_t *lens;
    int n;
    K3_CHECK_OK(k3_run_parse_prompts("1,2,3;4, 5 ;6", &ids, &lens, &n));
    K3_CHECK(n == 3 && lens[0] == 3 && lens[1] == 2 && lens[2] == 1, "n %d", n);
    int32_t want[] = {1, 2, 3, 4, 5, 6};
    for (int i = 0; i < 6 && n == 3; i++) K3_CHECK(ids[i] == want[i], "id %d = %d", i, ids[i]);
    k3_free(ids), k3_free(lens);
    K3_CHECK_OK(k3_run_parse_prompts("42", &ids, &lens, &n));
    K3_CHECK(n == 1 && lens[0] == 1 && ids[0] == 42, "single prompt");
    k3_free(ids), k3_free(lens);
    K3_CHECK_ERR(k3_run_parse_prompts("1,2;;3", &ids, &lens, &n), K3_ERR_ARG, "prompt 2 is empty");
    K3_CHECK_ERR(k3_run_parse_prompts("1,2;", &ids, &lens, &n), K3_ERR_ARG, "prompt 2 is empty");
    K3_CHECK_ERR(k3_run_parse_prompts("", &ids, &lens, &n), K3_ERR_ARG, "prompt 1 is empty");
    K3_CHECK_ERR(k3_run_parse_prompts("1,x", &ids, &lens, &n), K3_ERR_ARG, "prompt 1, id 2");
    K3_CHECK_ERR(k3_run_parse_prompts("1;2,-3", &ids, &lens, &n), K3_ERR_ARG, "prompt 2, id 2");
    K3_CHECK_ERR(k3_run_parse_prompts("1,2,;3", &ids, &lens, &n), K3_ERR_ARG,
                 "prompt 1 ends with ','");
    K3_CHECK_ERR(k3_run_parse_prompts("1 2", &ids, &lens, &n), K3_ERR_ARG, "unexpected '2'");
    K3_CHECK_ERR(k3_run_parse_prompts("99999999999", &ids, &lens, &n), K3_ERR_ARG,
                 "not a token id");
    K3_CHECK(ids == NULL && lens == NULL, "nothing left allocated on error");
    return k3_test_done("run_prompts");
}
