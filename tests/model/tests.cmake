# model/: config, catalogue, safetensors, weights loader, make-tiny, MXFP4 formats.
k3_add_test_exe(test_model_mxfp4 ${CMAKE_CURRENT_LIST_DIR}/test_mxfp4.c)
target_include_directories(test_model_mxfp4 PRIVATE ${CMAKE_SOURCE_DIR}/model)
add_test(NAME model_mxfp4 COMMAND test_model_mxfp4)
set_tests_properties(model_mxfp4 PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
k3_add_test_exe(test_model_config ${CMAKE_CURRENT_LIST_DIR}/test_config.c)
add_test(NAME model_config COMMAND test_model_config)
set_tests_properties(model_config PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
